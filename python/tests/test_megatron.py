"""Megatron-Core 0.19 sharded state dicts, built with Megatron's own ShardedTensor,
ShardedObject, ShardedTensorFactory and LocalNonpersistentObject, through tessera.save/load and
the tessera.megatron entry points, with ranks as threads: a TP x DP model with layers stacked on
a prepended axis, per-rank ShardedObjects, factories and non-persistent objects, loaded under
other layouts, in Megatron's torch_dist format (the default) and in tessera's; Megatron's strict
modes; the flattened ranges of Megatron-Core <= 0.13's distributed optimizer (0.19 refuses
them in its constructor: real ShardedTensors holding them are made as 0.13 made them).
Megatron's own save and load, its strategies and tessera's strategies over gloo processes:
test_megatron_interop.py."""

import warnings

import pytest
import torch
from megatron.core.dist_checkpointing import LocalNonpersistentObject, ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

import tessera
from tessera import megatron as dist_checkpointing

LAYERS, HIDDEN, FFN, VOCAB = 3, 4, 6, 10
FC1 = torch.arange(LAYERS * FFN * HIDDEN, dtype=torch.float32).reshape(LAYERS, FFN, HIDDEN)
EXP_AVG = -FC1 - 0.5
EMBEDDING = torch.arange(VOCAB * HIDDEN, dtype=torch.bfloat16).reshape(VOCAB, HIDDEN)
NORM = torch.linspace(0, 1, HIDDEN)
GLU = torch.arange(2 * FFN * HIDDEN, dtype=torch.float32).reshape(2 * FFN, HIDDEN)


def glu_factory(key, data, tp, tp_size, replica_id=0):
    """A ShardedTensorFactory as Megatron makes for a GLU weight: stored as two tensors (w, v),
    each sharded over TP; loaded back as the concatenation."""
    def build(key, data, replica_id, flattened_range):
        w, v = torch.chunk(data, 2)
        return {"w": ShardedTensor.from_rank_offsets(f"{key}_w", w, (0, tp, tp_size),
                                                     replica_id=replica_id),
                "v": ShardedTensor.from_rank_offsets(f"{key}_v", v, (0, tp, tp_size),
                                                     replica_id=replica_id)}

    def merge(sub):
        return torch.cat([sub["w"], sub["v"]])

    return ShardedTensorFactory(key, data, build, merge, replica_id)


def model_state(tp, tp_size, dp, dp_size, fill=True, legacy_flat=True):
    """One rank's Megatron sharded state dict: fc1 rows over TP with the layers on a prepended
    axis, the embedding's vocabulary over TP (padded: allow_shape_mismatch), the final norm
    replicated over TP and DP, the GLU weight through a factory, Adam's exp_avg of fc1 as the
    distributed optimizer shards it: the flat concatenation of this TP rank's layers split over
    the DP ranks (ranges start and end inside layers), per-rank RNG state as ShardedObjects,
    common state and a non-persistent object. legacy_flat=False: exp_avg sharded like fc1
    (what Megatron-Core 0.19 itself saves; it refuses flattened ranges)."""
    def value(full):
        return full.clone() if fill else torch.zeros_like(full)

    rows = FFN // tp_size
    layers = {}
    for layer in range(LAYERS):
        local = value(FC1[layer, tp * rows:(tp + 1) * rows])
        layers[str(layer)] = {"mlp.linear_fc1.weight": ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.linear_fc1.weight", local, (0, layer, LAYERS),
            (1, tp, tp_size), replica_id=(0, 0, dp), prepend_axis_num=1)}
    vocab = VOCAB // tp_size
    state = {
        "model": {
            "embedding.word_embeddings.weight": ShardedTensor.from_rank_offsets(
                "embedding.word_embeddings.weight",
                value(EMBEDDING[tp * vocab:(tp + 1) * vocab]), (0, tp, tp_size),
                replica_id=(0, 0, dp), allow_shape_mismatch=True),
            "decoder.layers": layers,
            "decoder.final_layernorm.weight": ShardedTensor.from_rank_offsets(
                "decoder.final_layernorm.weight", value(NORM), replica_id=(0, tp, dp)),
            "mlp.glu": glu_factory("mlp.glu", value(GLU_TP(tp, tp_size)), tp, tp_size,
                                   replica_id=(0, 0, dp)),
        },
        "optimizer": {"exp_avg": _distributed_optimizer_shards(tp, tp_size, dp, dp_size, fill)
                      if legacy_flat else _dense_optimizer_shards(tp, tp_size, dp, fill)},
        "rng_state": ShardedObject("rng_state", {"tp": tp, "dp": dp} if fill else None,
                                   (1, tp_size, dp_size), (0, tp, dp), replica_id=0),
        "iteration": 7 if fill else None,
        "args": {"lr": 0.25, "micro_batch_size": 2} if fill else None,
        "rerun_state_machine": LocalNonpersistentObject(f"local to {tp}.{dp}"),
    }
    return state


def GLU_TP(tp, tp_size):  # noqa: N802 (a constant's slice)
    """The GLU weight as TP rank `tp` holds it: its rows of w, then its rows of v."""
    w, v = torch.chunk(GLU, 2)
    rows = FFN // tp_size
    return torch.cat([w[tp * rows:(tp + 1) * rows], v[tp * rows:(tp + 1) * rows]])


def _distributed_optimizer_shards(tp, tp_size, dp, dp_size, fill):
    """exp_avg of fc1 as Megatron's distributed optimizer holds it on (tp, dp): this TP rank's
    layers, flattened and concatenated, split into dp_size ranges; one ShardedTensor per layer
    that the range touches, with the flattened_range inside that layer's local shard."""
    rows = FFN // tp_size
    numel = rows * HIDDEN
    total = LAYERS * numel
    begin, end = total * dp // dp_size, total * (dp + 1) // dp_size
    shards = {}
    for layer in range(LAYERS):
        lo, hi = max(begin, layer * numel), min(end, (layer + 1) * numel)
        if lo >= hi:
            continue
        local = EXP_AVG[layer, tp * rows:(tp + 1) * rows].reshape(-1)
        flat = slice(lo - layer * numel, hi - layer * numel)
        data = local[flat].clone() if fill else torch.zeros(hi - lo)
        shards[str(layer)] = flat_shard(
            "optimizer.exp_avg.decoder.layers.mlp.linear_fc1.weight", data, (rows, HIDDEN),
            (0, layer, LAYERS), (1, tp, tp_size), prepend_axis_num=1, flattened_range=flat)
    return shards


def _dense_optimizer_shards(tp, tp_size, dp, fill):
    """exp_avg of fc1 sharded like fc1 itself, replicated over DP."""
    rows = FFN // tp_size
    return {str(layer): ShardedTensor.from_rank_offsets(
        "optimizer.exp_avg.decoder.layers.mlp.linear_fc1.weight",
        EXP_AVG[layer, tp * rows:(tp + 1) * rows].clone() if fill else torch.zeros(rows, HIDDEN),
        (0, layer, LAYERS), (1, tp, tp_size), replica_id=(0, 0, dp), prepend_axis_num=1)
        for layer in range(LAYERS)}


def flat_shard(key, data, local_shape, *rank_offsets, flattened_range, **kwargs):
    """A Megatron ShardedTensor holding `data`, the slice `flattened_range` of its flattened
    local shard, as Megatron-Core 0.7-0.13's from_rank_offsets_flat made it for the distributed
    optimizer. Megatron-Core 0.19's constructor refuses flattened ranges (its distributed
    optimizer no longer makes them), so the fields are set after construction, as 0.13's
    dataclasses.replace did; checkpoints of those versions hold such tensors."""
    meta = torch.empty(local_shape, dtype=data.dtype, device="meta")
    st = ShardedTensor.from_rank_offsets(key, meta, *rank_offsets, **kwargs)
    st.data, st.flattened_range = data, flattened_range
    return st


def layout(rank, tp_size):
    return rank % tp_size, rank // tp_size  # (tp, dp)


def save_with(ckpt, tp_size, dp_size, save=dist_checkpointing.save, **options):
    def fn(comm):
        tp, dp = layout(comm.rank, tp_size)
        save(model_state(tp, tp_size, dp, dp_size), ckpt, comm=comm, **options)
    tessera.run_local(tp_size * dp_size, fn)


def check_loaded(result, tp, tp_size, dp, dp_size, legacy_flat=True):
    """The state dict dist_checkpointing.load returns, against the global tensors."""
    rows, vocab = FFN // tp_size, VOCAB // tp_size
    model = result["model"]
    for layer in range(LAYERS):
        got = model["decoder.layers"][str(layer)]["mlp.linear_fc1.weight"]
        assert torch.equal(got, FC1[layer, tp * rows:(tp + 1) * rows]), (layer, got)
    assert torch.equal(model["embedding.word_embeddings.weight"],
                       EMBEDDING[tp * vocab:(tp + 1) * vocab])
    assert torch.equal(model["decoder.final_layernorm.weight"], NORM)
    assert torch.equal(model["mlp.glu"], GLU_TP(tp, tp_size))
    expected = (_distributed_optimizer_shards(tp, tp_size, dp, dp_size, fill=True)
                if legacy_flat else _dense_optimizer_shards(tp, tp_size, dp, fill=True))
    assert sorted(result["optimizer"]["exp_avg"]) == sorted(expected)
    for layer, shard in expected.items():
        assert torch.equal(result["optimizer"]["exp_avg"][layer], shard.data), layer
    assert result["iteration"] == 7 and result["args"] == {"lr": 0.25, "micro_batch_size": 2}
    assert result["rerun_state_machine"] == f"local to {tp}.{dp}"


@pytest.mark.parametrize("save_layout, load_layout, format", [
    ((2, 2), (1, 1), "torch_dist"), ((2, 2), (2, 1), "tessera"), ((1, 3), (2, 2), "torch_dist"),
    ((2, 1), (1, 2), "tessera")])
def test_megatron_state_loads_under_other_layouts(ckpt, save_layout, load_layout, format):
    """(tp, dp) -> (tp, dp), in either format. The RNG ShardedObjects are per rank: a layout
    with other ranks asks for other shards, so the load skips what it does not ask for, as
    Megatron's default strictness does."""
    save_with(ckpt, *save_layout, format=format)
    tp_size, dp_size = load_layout

    def load(comm):
        tp, dp = layout(comm.rank, tp_size)
        request = model_state(tp, tp_size, dp, dp_size, fill=False)
        del request["rng_state"]
        result = dist_checkpointing.load(request, ckpt, comm=comm)
        check_loaded(result, tp, tp_size, dp, dp_size)
        # In place: the request's tensors hold the loaded values.
        fc1 = request["model"]["decoder.layers"]["1"]["mlp.linear_fc1.weight"]
        assert fc1.data is result["model"]["decoder.layers"]["1"]["mlp.linear_fc1.weight"]

    tessera.run_local(tp_size * dp_size, load)


def test_saved_keys_and_shapes_are_megatrons(ckpt):
    save_with(ckpt, 2, 2, format="tessera")
    metadata = tessera.read_metadata(ckpt)
    shapes = {t.key: list(t.shape) for t in metadata.tensors}
    assert shapes == {
        "decoder.layers.mlp.linear_fc1.weight": [LAYERS, FFN, HIDDEN],
        "optimizer.exp_avg.decoder.layers.mlp.linear_fc1.weight": [LAYERS, FFN, HIDDEN],
        "embedding.word_embeddings.weight": [VOCAB, HIDDEN],
        "decoder.final_layernorm.weight": [HIDDEN],
        "mlp.glu_w": [FFN, HIDDEN], "mlp.glu_v": [FFN, HIDDEN],
    }
    assert metadata.find_tensor("embedding.word_embeddings.weight").dtype == "BF16"
    objects = sorted(o.key for o in metadata.objects)
    assert [k for k in objects if k.startswith("rng_state/")] == [
        f"rng_state/shard_0.{tp}.{dp}_1.2.2" for tp in range(2) for dp in range(2)]
    assert "iteration" in objects and "args.lr" in objects
    assert not any("rerun" in k for k in objects)  # non-persistent: not saved
    plain = dist_checkpointing.load_plain_tensors(ckpt)
    assert sorted(plain) == sorted(shapes)
    assert torch.equal(plain["decoder.layers.mlp.linear_fc1.weight"], FC1)
    assert torch.equal(plain["optimizer.exp_avg.decoder.layers.mlp.linear_fc1.weight"], EXP_AVG)
    assert torch.equal(plain["embedding.word_embeddings.weight"], EMBEDDING)
    w, v = torch.chunk(GLU, 2)
    assert torch.equal(plain["mlp.glu_w"], w) and torch.equal(plain["mlp.glu_v"], v)


def test_load_all_gives_whole_tensors_at_every_path(ckpt):
    """load_all of stacked layers: each layer's path holds the one global tensor."""
    save_with(ckpt, 2, 1, format="tessera")
    loaded = tessera.load_all(ckpt)
    layers = loaded["model"]["decoder.layers"]
    assert torch.equal(layers["0"]["mlp.linear_fc1.weight"], FC1)
    assert layers["2"]["mlp.linear_fc1.weight"] is layers["0"]["mlp.linear_fc1.weight"]
    assert loaded["iteration"] == 7


@pytest.mark.parametrize("format", ["torch_dist", "tessera"])
def test_sharded_objects_come_back_by_value(ckpt, format):
    save_with(ckpt, 2, 2, format=format)

    def load(comm):
        tp, dp = layout(comm.rank, 2)
        request = model_state(tp, 2, dp, 2, fill=False)
        rng = request["rng_state"]
        result = dist_checkpointing.load(request, ckpt, comm=comm)
        assert result["rng_state"] == {"tp": tp, "dp": dp}
        assert request["rng_state"] is rng and rng.data is None  # the request keeps its leaf
        return result["iteration"]

    assert tessera.run_local(4, load) == [7] * 4

    # Through tessera.load: the ShardedObject leaf is replaced by its value in the state dict.
    def plain_load(comm):
        tp, dp = layout(comm.rank, 2)
        state = {"rng_state": ShardedObject("rng_state", None, (1, 2, 2), (0, tp, dp))}
        tessera.load(state, ckpt, comm=comm, strict=False)
        return state["rng_state"]

    with pytest.warns(tessera.PartialLoadWarning):
        assert tessera.run_local(4, plain_load) == [{"tp": tp, "dp": dp} for dp in range(2)
                                                    for tp in range(2)]


@pytest.mark.parametrize("format", ["torch_dist", "tessera"])
def test_common_state_comes_back_whatever_the_request_holds(ckpt, format):
    """As Megatron's load: the common (non-sharded) part of the result is the checkpoint's."""
    tessera.megatron.save({"model": {"w": ShardedTensor.from_rank_offsets("w", torch.ones(3))},
                           "iteration": 9, "args": {"lr": 0.5}}, ckpt,
                          content_metadata={"format": 2}, format=format)
    w = torch.zeros(3)
    request = {"model": {"w": ShardedTensor.from_rank_offsets("w", w)}, "not_saved": 1}
    result = dist_checkpointing.load(request, ckpt)
    assert result == {"model": {"w": w}, "iteration": 9, "args": {"lr": 0.5},
                      "content_metadata": {"format": 2}}
    assert torch.equal(w, torch.ones(3))


def test_prepended_axes_and_replica_ids_with_plain_tessera_calls(ckpt):
    """tessera.save/tessera.load take Megatron leaves directly; int and tuple replica ids; two
    prepended axes (e.g. experts x layers); data None is allocated on load."""
    full = torch.arange(2 * 3 * 4 * 5, dtype=torch.float64).reshape(2, 3, 4, 5)

    def save(comm):
        expert, layer = divmod(comm.rank, 3)
        state = {"w": ShardedTensor.from_rank_offsets(
            "experts.w", full[expert, layer].clone(), (0, expert, 2), (1, layer, 3),
            prepend_axis_num=2, replica_id=0),
            "replicated": ShardedTensor.from_rank_offsets("r", torch.ones(2),
                                                          replica_id=comm.rank)}
        tessera.save(state, ckpt, comm=comm)

    tessera.run_local(6, save)
    assert torch.equal(tessera.load_all(ckpt)["w"], full)
    # One rank, the whole tensor: a (1, 1)-prepended view of a 2-D piece at every offset.
    pieces = {}
    for expert in range(2):
        for layer in range(3):
            pieces[f"{expert}.{layer}"] = ShardedTensor(
                "experts.w", None, torch.float64, (4, 5), (2, 3, 4, 5), (expert, layer, 0, 0),
                None, replica_id=(0, 0), prepend_axis_num=2)
    pieces["r"] = ShardedTensor("r", None, torch.float32, (2,), (2,), (0,), None)
    tessera.load(pieces, ckpt)
    for expert in range(2):
        for layer in range(3):
            assert torch.equal(pieces[f"{expert}.{layer}"].data, full[expert, layer])
    assert torch.equal(pieces["r"].data, torch.ones(2))


def test_flattened_ranges_start_and_end_anywhere(ckpt):
    """Ranges over the flattened local shard that cut rows, saved from 3 ranks, loaded as other
    ranges on 2 and as a dense shard on 1."""
    full = torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7)
    cuts = [0, 4, 23, 35]

    def save(comm):
        flat = slice(cuts[comm.rank], cuts[comm.rank + 1])
        data = full.reshape(-1)[flat].clone()
        tessera.save({"m": flat_shard("m", data, (5, 7), flattened_range=flat)},
                     ckpt, comm=comm)

    tessera.run_local(3, save)

    def load(comm):
        flat = slice(0, 11) if comm.rank == 0 else slice(11, 35)
        data = torch.zeros(flat.stop - flat.start)
        tessera.load({"m": flat_shard("m", data, (5, 7), flattened_range=flat)},
                     ckpt, comm=comm)
        return torch.equal(data, full.reshape(-1)[flat])

    assert tessera.run_local(2, load) == [True, True]
    dense = torch.zeros(2, 7)  # rows 2:4, dense
    rows = ShardedTensor("m", dense, torch.float32, (2, 7), (5, 7), (2, 0), None)
    tessera.load({"m": rows}, ckpt)
    assert torch.equal(dense, full[2:4])


def test_strict_modes(ckpt):
    save_with(ckpt, 1, 1)

    def request():
        state = model_state(0, 1, 0, 1, fill=False)
        del state["optimizer"]  # in the checkpoint, asked for by nobody: Megatron's "missing"
        state["absent"] = ShardedTensor.from_rank_offsets("absent.w", torch.zeros(2))
        state["absent_object"] = ShardedObject("absent.o", None, (1,), (0,))
        return state

    # Default (assume_ok_unexpected): a key asked for but absent is an error, in Megatron's
    # terms; unasked keys of the checkpoint are fine.
    with pytest.raises(tessera.MissingKeysError) as info:
        dist_checkpointing.load(request(), ckpt)
    message = str(info.value)
    assert "'absent.w'" in message and "'absent.o/shard_0_1'" in message
    assert "(pass strict='log_unexpected' or 'return_unexpected' to load the rest)" in message
    assert "strict=False" not in message

    with pytest.warns(tessera.PartialLoadWarning, match="2 keys not loaded: 2 asked for but "
                                                        "absent from the checkpoint"):
        result = dist_checkpointing.load(request(), ckpt, strict="log_unexpected")
    assert "absent" not in result and "absent_object" not in result
    assert "optimizer" not in result and result["iteration"] == 7
    with pytest.warns(tessera.PartialLoadWarning, match="3 keys not loaded.*1 in the "):
        dist_checkpointing.load(request(), ckpt, strict="log_all")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning
        result, missing, unexpected = dist_checkpointing.load(request(), ckpt,
                                                              strict="return_all")
        assert unexpected == {"absent.w", "absent.o"}
        assert missing == {"optimizer.exp_avg.decoder.layers.mlp.linear_fc1.weight"}
        result, missing, unexpected = dist_checkpointing.load(request(), ckpt,
                                                              strict="return_unexpected")
        assert missing == set() and unexpected == {"absent.w", "absent.o"}
        result = dist_checkpointing.load(request(), ckpt, strict="ignore_all")
        assert result["iteration"] == 7

    # raise_all: a key of the checkpoint nobody asks for is an error too.
    state = request()
    del state["absent"], state["absent_object"]
    with pytest.raises(tessera.InvalidArgumentError, match="keys no rank asked for: "
                                                           "'optimizer.exp_avg.decoder"):
        dist_checkpointing.load(state, ckpt, strict="raise_all")
    with pytest.raises(ValueError, match="strict must be one of"):
        dist_checkpointing.load(state, ckpt, strict="sometimes")

    class StrictHandling:  # an enum member, as Megatron passes it
        value = "ignore_all"

    assert dist_checkpointing.load(request(), ckpt, strict=StrictHandling())["iteration"] == 7


def test_async_save_and_strategies(ckpt):
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4)), "iteration": 3}
    handle = dist_checkpointing.save(state, ckpt, async_sharded_save=True)
    assert isinstance(handle, tessera.AsyncSaveHandle)
    handle.wait()
    with pytest.warns(UserWarning, match="sharded_strategy=object is ignored"):
        dist_checkpointing.save(state, ckpt + "2", object())
    assert dist_checkpointing.load_plain_tensors(ckpt + "2")["w"].tolist() == [1.0] * 4


def test_errors_name_the_megatron_key(ckpt):
    bad = ShardedTensor.from_rank_offsets("k", torch.zeros(2, 3))
    bad.local_shape = (3, 2)
    with pytest.raises(ValueError, match="Megatron ShardedTensor 'k': data has shape"):
        tessera.save({"x": bad}, ckpt)
    flat = flat_shard("f", torch.zeros(4), (2, 3), flattened_range=slice(1, 5))
    flat.flattened_range = slice(1, 5, 2)
    with pytest.raises(ValueError, match="'f': flattened_range must be a slice"):
        tessera.save({"x": flat}, ckpt)
    # Pieces of one key on one rank are fine (layers 0 and 2 of 3), but layer 1 is missing.
    gaps = {str(layer): ShardedTensor.from_rank_offsets("g", torch.zeros(2), (0, layer, 3),
                                                        prepend_axis_num=1)
            for layer in (0, 2)}
    with pytest.raises(ValueError, match="key 'g': the boxes cover 4 of the 6 elements"):
        tessera.save(gaps, ckpt)
