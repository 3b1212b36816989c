"""Train a GLA language model.

    python train.py --config configs/tiny.py                      # embedded corpus, CPU, minutes
    python train.py --config configs/tiny.py --config.opt.lr=1e-3 --workdir runs/lr1e-3
    python train.py --config configs/3b.py --plan                 # compile for 64 devices, report
    python train.py --config configs/3b.py --plan --topology v5p:2x2x4   # the TPU compiler's view
    python train.py --config configs/3b.py --config.data.path=data/fineweb
    python train.py --config configs/tiny.py --profile_steps 10:12  # trace; tensorboard --logdir runs/tiny/tb

Rerunning the same command resumes from the newest checkpoint in --workdir. Multi-host: run one
process per host with --coordinator_address/--num_processes/--process_id (or the JAX_*
environment variables your cluster sets).
"""

import os

from absl import flags
from ml_collections import config_flags

from laplace_jax import cli

config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/tiny.py.", lock_config=True)
flags.mark_flag_as_required("config")
flags.DEFINE_string("workdir", None, "Checkpoints, metrics.jsonl, tb/ and loss.png (default runs/<config name>).")
flags.DEFINE_bool("plan", False, "Compile the sharded step for the config's mesh on fake CPU devices and report.")
flags.DEFINE_bool("json", False, "With --plan: print the report as JSON.")
flags.DEFINE_string(
    "topology",
    None,
    "With --plan: compile for this TPU topology instead (e.g. v5e:2x2, v5p:2x2x4; needs the tpu extra, no TPU) "
    "and add the TPU compiler's estimated step time, tokens/s, MFU and the run's days and cost.",
)
flags.DEFINE_float("usd_per_chip_hour", 0.0, "With --plan --topology: price of one chip-hour for the run's cost.")
flags.DEFINE_string(
    "profile_steps",
    None,
    "FIRST:LAST: a jax.profiler trace of those steps (as the log numbers them, both included) into "
    "<workdir>/tb; view it with tensorboard --logdir <workdir>/tb (profile tab) or XProf.",
)
flags.DEFINE_string("compile_cache_dir", None, "Persistent compile cache (JAX; Neuron's too on Neuron).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for multi-process runs.")
flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run.")
flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from laplace_jax.config import RunConfig
    from laplace_jax.errors import UserError

    cfg = RunConfig.from_mapping(FLAGS.config)  # every block checked: a typo fails before anything compiles
    if FLAGS.topology and not FLAGS.plan:
        raise UserError("--topology goes with --plan (this machine compiles for a TPU but cannot run on one)")
    profile_steps = None
    if FLAGS.profile_steps:
        from laplace_jax.profiling import parse_steps

        if FLAGS.plan:
            raise UserError("--profile_steps traces training steps; --plan compiles without running any")
        profile_steps = parse_steps(FLAGS.profile_steps)
    if FLAGS.plan:
        print(cli.plan_text(cfg, FLAGS.topology, FLAGS.usd_per_chip_hour, FLAGS.json))
        return
    import jax

    if FLAGS.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=FLAGS.coordinator_address,
            num_processes=FLAGS.num_processes,
            process_id=FLAGS.process_id,
        )
    if FLAGS.compile_cache_dir:
        from laplace_jax.platform import set_compile_cache

        set_compile_cache(FLAGS.compile_cache_dir)
    from laplace_jax.train.loop import run

    name = os.path.splitext(os.path.basename(config_flags.get_config_filename(FLAGS["config"])))[0]
    run(cfg, FLAGS.workdir or os.path.join("runs", name), profile_steps=profile_steps)


if __name__ == "__main__":
    cli.run(main)
