"""torch.compile with PnMixCache: the cache's entry points run eagerly (torch.compiler.disable), so
torch.compile without fullgraph breaks the graph around them and computes what eager does, while
fullgraph=True stops at them with the reason; is_compileable is False."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers 5.x is the optional `hf` extra")

from pnmix.hf import PnMixCache  # noqa: E402
from pnmix.hf.cache import COMPILE_REASON  # noqa: E402
from pnmix.testing import tiny_llama  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
SMALL = dict(group_size=16, residual_size=24, sink_tokens=4)


def test_fullgraph_compile_stops_at_the_cache_saying_why():
    model = tiny_llama()
    assert PnMixCache(**SMALL).is_compileable is False
    forward = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad(), pytest.raises(Exception) as error:
        forward(input_ids=torch.randint(1, 256, (1, 30)), cache=PnMixCache(**SMALL), use_cache=True)
    assert COMPILE_REASON in str(error.value)


@pytest.mark.slow  # inductor compiles the graph pieces between the cache calls
def test_compile_without_fullgraph_computes_what_eager_does():
    model = tiny_llama()
    forward = torch.compile(model.forward)
    ids = torch.randint(1, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    compiled, eager = PnMixCache(**SMALL), PnMixCache(**SMALL)
    with torch.no_grad():
        for _ in range(4):
            got = forward(input_ids=ids, cache=compiled, use_cache=True).logits[:, -1]
            want = model(input_ids=ids, cache=eager, use_cache=True).logits[:, -1]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            ids = want.argmax(-1, keepdim=True)
    assert compiled.get_seq_length() == eager.get_seq_length() == 33
