"""torch view flags (issue 30, item 17): a save stores a tensor's values, whatever view it is;
a load never writes through a view whose memory holds other values than the tensor."""

import pytest
import torch

import tessera


def _base():
    return torch.arange(1, 13, dtype=torch.float32).reshape(3, 4)


def _complex():
    return torch.complex(torch.arange(1.0, 7.0), torch.arange(11.0, 17.0))


# (name, a tensor built with that view flag). Each is saved and must come back with its values.
SAVE_VIEWS = [
    ("neg_bit_imag_of_conj", lambda: _complex()[2:3].conj().imag),  # negative bit, [1]
    ("neg_bit_scalar", lambda: _complex()[4].conj().imag),
    ("neg_view", lambda: torch._neg_view(_base())),  # negative bit
    ("neg_view_bfloat16", lambda: torch._neg_view(_base().to(torch.bfloat16))),
    ("real_of_conj", lambda: _complex()[1:2].conj().real),  # no bit: a real view
    ("storage_offset", lambda: _base().reshape(-1)[5:9]),
    ("row_slice", lambda: _base()[1:]),
    ("expanded_size_one", lambda: torch.tensor([7.0]).expand(1, 1)),
    ("zero_size", lambda: torch.empty(0, 3)),
    ("scalar", lambda: torch.tensor(2.5)),
]


@pytest.mark.parametrize("name,make", SAVE_VIEWS, ids=[n for n, _ in SAVE_VIEWS])
@pytest.mark.parametrize("how", ["save", "async_save"])
def test_save_stores_the_values_of_every_view(tmp_path, name, make, how):
    value = make()
    expected = value.clone().resolve_conj().resolve_neg()
    path = str(tmp_path / "ckpt")
    if how == "save":
        tessera.save({"t": value}, path)
    else:
        tessera.async_save({"t": value}, path).wait()
    back = tessera.load_all(path)["t"]
    assert back.dtype == expected.dtype
    assert list(back.shape) == list(expected.shape)
    assert torch.equal(back, expected), (name, back, expected)
    # The source is left as it was (still a view with its flag).
    assert value.is_neg() == make().is_neg()


def test_neg_view_in_a_replicated_state_saves_its_values(tmp_path):
    """The replica check hashes the values too (a neg view and its resolved copy agree)."""
    value = torch._neg_view(_base())
    path = str(tmp_path / "ckpt")
    tessera.save({"w": value, "step": 3}, path)
    assert torch.equal(tessera.load_all(path)["w"], -_base())


NON_CONTIGUOUS = [
    ("transposed", lambda: _base().t()),
    ("strided_slice", lambda: _base()[:, ::2]),
    ("expanded_stride_zero", lambda: torch.arange(4.0).expand(3, 4)),
]


@pytest.mark.parametrize("name,make", NON_CONTIGUOUS, ids=[n for n, _ in NON_CONTIGUOUS])
def test_non_contiguous_views_are_refused_by_name_on_save_and_load(tmp_path, name, make):
    path = str(tmp_path / "ckpt")
    with pytest.raises(tessera.InvalidArgumentError, match="'bad'.*not contiguous"):
        tessera.save({"bad": make()}, path)
    tessera.save({"bad": make().contiguous()}, path)
    with pytest.raises(tessera.InvalidArgumentError, match="'bad'.*not contiguous"):
        tessera.load({"bad": make()}, path)


LOAD_TARGETS = [
    ("neg_view", lambda: torch._neg_view(torch.zeros(3, 4))),
    ("neg_bit_imag_of_conj", lambda: torch.zeros(1, dtype=torch.complex64).conj().imag),
]


@pytest.mark.parametrize("name,make", LOAD_TARGETS, ids=[n for n, _ in LOAD_TARGETS])
def test_load_into_a_negative_view_is_refused_naming_the_key(tmp_path, name, make):
    path = str(tmp_path / "ckpt")
    target = make()
    tessera.save({"layer.w": torch.ones(target.shape)}, path)
    base_before = target.resolve_neg().clone()
    with pytest.raises(tessera.InvalidArgumentError, match="'layer.w'.*negative bit"):
        tessera.load({"layer.w": target}, path)
    assert torch.equal(target.resolve_neg(), base_before)  # nothing written through it


def test_load_into_storage_offset_view_writes_the_right_elements(tmp_path):
    path = str(tmp_path / "ckpt")
    tessera.save({"t": torch.arange(4.0)}, path)
    base = torch.zeros(10)
    tessera.load({"t": base[3:7]}, path)
    assert torch.equal(base, torch.tensor([0, 0, 0, 0, 1, 2, 3, 0, 0, 0], dtype=torch.float32))
