"""Laplace 3B trained on 32,768-token sequences, each split over 8 devices (context parallelism).

    python train.py --config configs/3b_32k.py --plan     # memory, collectives, time on 64 devices

The 3B config (configs/3b.py) with sequences 16x longer and the same 524,288 tokens per step:
16 sequences of 32,768, each cut into 8 slices of 4,096 tokens (mesh.context=8), the parameters
sharded 8 ways (mesh.fsdp=8). Each device then holds the activations of 2 x 4,096 tokens, as in
the 2,048-token run, where 64-way FSDP alone would have to hold one whole 32k sequence per device
(which does not fit 24 GiB: docs/context.md). Per layer, what crosses devices
is one all-gather of the 8 slices' fixed-size GLA states and the short convolution's last 4 inputs.
"""

import os

from laplace_jax.config import load_config_file

SEQ = 32_768


def get_config():
    c = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "3b.py"))
    c.model.max_seq_len = SEQ
    c.data.update(seq_len=SEQ, global_batch=16)
    c.mesh.update(data=1, fsdp=8, context=8)
    return c
