import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pnmix import quant


def _group(seed, n, scale=1.0):
    return (torch.randn(4, n, generator=torch.Generator().manual_seed(seed)) * scale).half()


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(2, 8), n=st.sampled_from([8, 16, 128]), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 1.0, 100.0]))
def test_dequantization_error_is_at_most_half_a_step(bits, n, seed, scale):
    x = _group(seed, n, scale)
    step, offset = quant.choose_qparams(x, bits)
    xhat = quant.dequantize(quant.quantize(x, step, offset, bits), step, offset)
    err = (xhat - x.float()).abs()
    # step/2 from rounding, plus what rounding step itself to fp16 moves the top code by.
    exact_step = (x.float().amax(-1) - x.float().amin(-1)) / (2**bits - 1)
    slack = (2**bits - 1) * (step.float() - exact_step).abs()
    bound = step.float() / 2 + slack + 1e-6 * scale
    assert (err <= bound.unsqueeze(-1)).all()


def test_two_bit_codes_span_min_to_max():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).half()
    step, offset = quant.choose_qparams(x, 2)
    assert step.item() == 1.0 and offset.item() == 0.0
    assert quant.quantize(x, step, offset, 2).tolist() == [[0, 1, 2, 3]]


def test_one_bit_uses_mean_and_mean_absolute_deviation():
    x = torch.tensor([[1.0, 3.0, 5.0, 7.0]]).half()  # mu 4, a 2 -> offset 2, step 4
    step, offset = quant.choose_qparams(x, 1)
    assert (step.item(), offset.item()) == (4.0, 2.0)
    assert quant.quantize(x, step, offset, 1).tolist() == [[0, 0, 1, 1]]  # 0.75 -> 1, 0.25 -> 0


def test_round_half_to_even():
    # (x - 0) / 1 = 0.5, 1.5, 2.5 -> 0, 2, 2
    x = torch.tensor([[0.5, 1.5, 2.5, 0.0, 7.0]]).half()
    step = torch.tensor([1.0]).half()
    offset = torch.tensor([0.0]).half()
    assert quant.quantize(x, step, offset, 3).tolist() == [[0, 2, 2, 0, 7]]


@pytest.mark.parametrize("bits", [1, 2, 3, 8])
def test_constant_group_has_zero_step_and_zero_codes(bits):
    x = torch.full((1, 16), 2.5).half()
    step, offset = quant.choose_qparams(x, bits)
    assert step.item() == 0.0
    assert (quant.quantize(x, step, offset, bits) == 0).all()
    assert (quant.dequantize(quant.quantize(x, step, offset, bits), step, offset) == 2.5).all()


def test_step_and_offset_saturate_instead_of_overflowing():
    x = torch.tensor([[-65504.0, 65504.0] * 4]).half()
    for bits in (1, 2):
        step, offset = quant.choose_qparams(x, bits)
        assert torch.isfinite(step).all() and torch.isfinite(offset).all()
