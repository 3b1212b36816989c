"""Peak memory of importing a sharded fla checkpoint (``convert.load_fla``), against its shards.

    python -m benchmarks.bench_import --d-model 1024 --layers 8 --shards 4 --out benchmarks/results/import_memory.json

Writes a random fla GLA checkpoint (bf16, split into ``--shards`` files with an index), then
imports it in a fresh process and reads that process's peak resident memory. The import's own
cost is the peak above the process baseline minus the float32 parameters it returns (which any
import must hold); the report gives it against the largest shard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from benchmarks.common import write_result

CHILD = """
import json, sys
import numpy as np
from laplace_jax.convert import load_fla
import jax

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident size (VmHWM) to the current one: imports are not counted
base = status("VmRSS:")
cfg, params = load_fla(sys.argv[1])
out = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
print(json.dumps({"baseline": base, "peak": status("VmHWM:"), "params": out}))
"""


def write_checkpoint(path: str, d: int, layers: int, shards: int) -> list[int]:
    from laplace_jax.config import ModelConfig
    from laplace_jax.convert import config_to_fla, params_to_state_dict
    from laplace_jax.models.gla_lm import abstract_params

    cfg = ModelConfig(vocab_size=32000, d_model=d, n_layers=layers, n_heads=max(1, d // 256))
    rng = np.random.default_rng(0)
    import jax

    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32) * 0.02, abstract_params(cfg))
    sd = params_to_state_dict(cfg, params, np.dtype(ml_dtypes.bfloat16))
    names = sorted(sd)
    groups = [names[i::shards] for i in range(shards)]
    weight_map, sizes = {}, []
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in group}, os.path.join(path, fname), {"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
        sizes.append(os.path.getsize(os.path.join(path, fname)))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_fla(cfg), f)
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as path:
        sizes = write_checkpoint(path, a.d_model, a.layers, a.shards)
        proc = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    extra = r["peak"] - r["baseline"] - r["params"]
    res = {
        "shards": a.shards,
        "shard_bytes": sizes,
        "largest_shard_bytes": max(sizes),
        "checkpoint_bytes": sum(sizes),
        "params_fp32_bytes": r["params"],
        "peak_above_baseline_bytes": r["peak"] - r["baseline"],
        "import_overhead_bytes": extra,
        "overhead_over_largest_shard": extra / max(sizes),
    }
    print(
        f"checkpoint {sum(sizes) / 1e9:.2f} GB in {a.shards} shards (largest {max(sizes) / 1e9:.2f} GB); "
        f"params {r['params'] / 1e9:.2f} GB fp32; peak above baseline {(r['peak'] - r['baseline']) / 1e9:.2f} GB; "
        f"import overhead {extra / 1e9:.2f} GB = {extra / max(sizes):.2f}x the largest shard"
    )
    write_result(res, "bench_import", argv, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
