"""The serving tests' shared server: the tiny model behind the HTTP API in one configuration,
started once for every test that asks for ``srv``."""

import pytest
from serving_helpers import Running


@pytest.fixture(scope="session")
def srv():
    """4 slots, 16-token prefill chunks, 4 tokens per decode call, room for 200 queued requests
    (the fuzz test's bursts). A test that needs another configuration starts its own ``Running``."""
    s = Running(max_num_seqs=4, prefill_chunk=16, steps_per_call=4, max_queue=200)
    yield s
    s.close()
