"""Train a GLA language model.

    python train.py --config configs/tiny.py                      # embedded corpus, CPU, minutes
    python train.py --config configs/tiny.py --config.opt.lr=1e-3 --workdir runs/lr1e-3
    python train.py --config configs/3b.py --plan                 # compile for 64 devices, report
    python train.py --config configs/3b.py --config.data.path=data/fineweb

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
flags.DEFINE_string("compile_cache_dir", None, "Persistent compile cache (JAX; Neuron's too on Neuron).")
flags.DEFINE_string("coordinator_address", None, "host:port of process 0 for multi-process runs.")
flags.DEFINE_integer("num_processes", None, "Number of processes in a multi-process run.")
flags.DEFINE_integer("process_id", None, "This process's index in a multi-process run.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    from laplace_jax.config import RunConfig

    cfg = RunConfig.from_mapping(FLAGS.config)  # every block checked: a typo fails before anything compiles
    if FLAGS.plan:
        n = max(1, cfg.mesh.data) * max(1, cfg.mesh.fsdp)
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        jax.config.update("jax_num_cpu_devices", n)
        import json

        from laplace_jax.train.plan import format_plan, plan

        rep = plan(cfg)
        print(json.dumps(rep, indent=2) if FLAGS.json else format_plan(rep))
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
    run(cfg, FLAGS.workdir or os.path.join("runs", name))


if __name__ == "__main__":
    cli.run(main)
