"""strategy='fsdp' (FSDP2's fully_shard over gloo, on CPU) without Spark: the same weights as DDP, each rank
holding 1/N of the parameters and the optimizer's state, checkpoints written by every rank with Distributed
Checkpoint and resumed on another rank count."""
import functools
import os

import pytest
import torch
from torch import nn

from estimator.launch.local import LocalLauncher
from estimator.train.checkpoint import load_checkpoint, restore
from estimator.train.sharding import unit_modules
from helpers import BlockMLP, BreakingMLP, Residual, make_spec, metrics, seeded


def trained(store, run, optimizer_cls=torch.optim.AdamW, epoch=None):
    """The run's checkpoint (or its best one of `epoch`) as a plain BlockMLP and its optimizer (fsdp's shards
    gathered on this process)."""
    model = BlockMLP()
    optimizer = optimizer_cls(model.parameters(), lr=0.01)
    layout = store.run(run)
    state = restore(store, layout, layout.checkpoint if epoch is None else layout.best(epoch), model, optimizer)
    return model, optimizer, state


def spec(store, digits, run, **fields):
    model = seeded(BlockMLP)
    return make_spec(store, digits, model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01),
                     train_rows=1000, val_rows=150, batch=50, run=run, **fields)


def test_the_default_units_are_the_items_of_module_lists_children_first():
    model = BlockMLP(blocks=3)
    assert unit_modules(model) == list(reversed(list(model.blocks)))
    assert unit_modules(model, [nn.Linear]) == [model.head, *[b.linear for b in reversed(model.blocks)], model.embed]
    assert unit_modules(model, lambda m: m is model.head) == [model.head]


def test_reshard_after_forward_false_keeps_the_units_gathered_until_backward_and_changes_no_gradient():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from estimator.train.distributed import forget_sharding_specs
    from estimator.train.sharding import shard

    x, y = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)), torch.arange(8) % 10
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    got = {}
    try:
        for reshard in (True, False):
            model = seeded(BlockMLP)
            shard(model, None, "32", torch.device("cpu"), 1, reshard_after_forward=reshard)
            loss = nn.functional.cross_entropy(model(x), y)
            got[reshard] = isinstance(model.blocks[0].linear.weight, DTensor)  # between forward and backward
            loss.backward()
            got[reshard, "grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
        forget_sharding_specs()
    assert got[True] and not got[False]  # resharded after forward (a DTensor again), or kept gathered
    for name, grad in got[True, "grads"].items():
        assert torch.equal(got[False, "grads"][name], grad), name


def test_two_sharded_ranks_train_the_weights_of_two_ddp_ranks_and_hold_half_the_state(store, digits):
    ddp = LocalLauncher().run(spec(store, digits, "ddp", shared_memory_allreduce=False), 2)
    fsdp = LocalLauncher().run(spec(store, digits, "fsdp", strategy="fsdp"), 2)
    for a, b in zip(ddp[0].history, fsdp[0].history):
        assert metrics(a) == pytest.approx(metrics(b), rel=1e-5)
    (plain, plain_opt, _), (sharded, sharded_opt, state) = trained(store, "ddp"), trained(store, "fsdp")
    for name, value in plain.state_dict().items():
        assert torch.allclose(sharded.state_dict()[name], value, atol=1e-6), name
    for index, value in plain_opt.state_dict()["state"].items():
        assert torch.allclose(sharded_opt.state_dict()["state"][index]["exp_avg_sq"], value["exp_avg_sq"], atol=1e-7)
    assert "model" not in state and state["strategy"] == "fsdp"
    best = [e for e in range(1, 3) if store.exists(store.run("fsdp").best(e))]  # save_top_k=1: what restore_best reads
    assert len(best) == 1 and store.exists(store.run("ddp").best(best[0]))
    best_ddp, best_fsdp = (trained(store, run, epoch=best[0])[0].state_dict() for run in ("ddp", "fsdp"))
    for name, value in best_ddp.items():
        assert torch.allclose(best_fsdp[name], value, atol=1e-6), name
    folder = store.run("fsdp").root + "/sharded/" + state["sharded"]
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank
    LocalLauncher().run(spec(store, digits, "compiled", strategy="fsdp", compile={"backend": "aot_eager"}), 2)
    for name, value in trained(store, "compiled")[0].state_dict().items():  # each block compiled, then sharded
        assert torch.allclose(value, sharded.state_dict()[name], atol=1e-6), name
    whole = ddp[0].state_bytes
    assert whole > 0 and all(r.state_bytes == pytest.approx(whole / 2, rel=0.1) for r in fsdp), \
        (whole, [r.state_bytes for r in fsdp])
    assert fsdp[0].allreduce == "gloo reduce-scatter (fsdp: model, gradients and optimizer state in 2 shards)"


class Prefixed(BlockMLP):
    """Declares the prefix its weights have in a folder of a larger model, as transformers' base models do: read
    from a folder naming them mlp.<name>, as from_pretrained reads a BertModel from a BertForMaskedLM's folder."""
    base_model_prefix = "mlp"


def meta_block_mlp():
    """A BlockMLP whose blocks and embedding are on the meta device (their weights are read from a folder, where
    their names have the prefix it declares) and whose head is built with values - by each rank, from its own
    generator."""
    from estimator import parameters_on_meta

    with parameters_on_meta():
        model = Prefixed()
    model.head = nn.Linear(48, 10)
    return model


def recorded(folder, build):
    """`build`'s module, its initial state saved in `folder` under this process's id. It draws from a seed of its
    own (this process's id), not the run's (the ranks build under the run's seed): each rank draws other values."""
    torch.manual_seed(os.getpid())
    model = build()
    torch.save(model.state_dict(), os.path.join(folder, f"{os.getpid()}.pt"))
    return model


def test_a_model_built_on_the_meta_device_reads_each_ranks_shards_and_starts_from_rank_0s_head(store, digits,
                                                                                                 tmp_path):
    """The factory's meta tensors come from the folder (each fsdp rank reads its own shards, named with the prefix
    the model declares, in bfloat16), and its head, built
    with values that differ on each rank, is rank 0's on every rank, as DDP starts: with lr=0 the run's checkpoint
    is the folder's weights and one rank's whole head (each rank keeping its slice of its own head would mix
    them); so is a whole model a factory draws anew on each rank. Seeded alike, 2 fsdp ranks then train what 2
    ddp ranks train, whose ranks read the folder whole."""
    from safetensors.torch import save_file

    from estimator.fit.recipes import model_of

    weights, starts = tmp_path / "weights", tmp_path / "starts"
    weights.mkdir(), starts.mkdir()
    # saved in bfloat16, as most published checkpoints are (the float32 model reads them cast): these values
    body = {k: v.to(torch.bfloat16).float() for k, v in seeded(BlockMLP).state_dict().items() if k[:5] != "head."}
    save_file({f"mlp.{k}": v.to(torch.bfloat16) for k, v in body.items()}, str(weights / "model.safetensors"))
    factory = functools.partial(recorded, str(starts), meta_block_mlp)
    driver, _ = model_of(factory, str(weights))  # the driver's copy, read whole
    for name, value in body.items():
        assert torch.equal(driver.state_dict()[name], value), name
    os.remove(starts / f"{os.getpid()}.pt")

    def fit(run, strategy, build, lr, folder=str(weights)):
        LocalLauncher().run(make_spec(store, digits, driver, functools.partial(torch.optim.SGD, lr=lr, momentum=0.9),
                                      train_rows=1000, val_rows=150, batch=50, epochs=1, run=run, model_factory=build,
                                      weights_folder=folder, strategy=strategy, shared_memory_allreduce=False), 2)
        return trained(store, run, torch.optim.SGD)[0].state_dict()

    for run, build, folder, drawn in (("start", factory, str(weights), ("head.weight", "head.bias")),
                                      ("random", functools.partial(recorded, str(starts), BlockMLP), None, body)):
        start = fit(run, "fsdp", build, 0.0, folder)
        if folder:
            for name, value in body.items():
                assert torch.equal(start[name], value), name
        heads = [torch.load(starts / f, weights_only=True) for f in os.listdir(starts)]
        assert len(heads) == 2 and not torch.equal(heads[0]["head.weight"], heads[1]["head.weight"])
        assert [all(torch.equal(start[k], h[k]) for k in drawn) for h in heads].count(True) == 1, run
        for f in os.listdir(starts):
            os.remove(starts / f)
    alike = functools.partial(seeded, meta_block_mlp, seed=5)
    fsdp, ddp = fit("meta-fsdp", "fsdp", alike, 0.05), fit("meta-ddp", "ddp", alike, 0.05)
    for name, value in ddp.items():
        assert torch.allclose(fsdp[name], value, atol=1e-6), name
    assert not torch.allclose(fsdp["head.weight"], start["head.weight"])


class Breaking(Residual):
    """A graph break: torch.compile(fullgraph=True) refuses it, so a refusal shows that compile ran on it."""

    def forward(self, x):
        torch._dynamo.graph_break()
        return super().forward(x)


class BreakingBlocks(BlockMLP):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Breaking(48) for _ in self.blocks])


@pytest.mark.parametrize("build", [BreakingBlocks, BreakingMLP], ids=["each block", "a model without units, whole"])
def test_the_sharded_ranks_really_compile(store, digits, build):
    """compile with fsdp compiles each unit before sharding it, or the whole model when it has no other unit."""
    from estimator.failures import RankFailed

    model = seeded(build)
    fullgraph = make_spec(store, digits, model, torch.optim.SGD(model.parameters(), lr=0.1), train_rows=200,
                          val_rows=50, batch=50, epochs=1, run=f"full-{build.__name__}", strategy="fsdp",
                          compile={"backend": "aot_eager", "fullgraph": True}, collective_timeout=20.0)
    with pytest.raises(RankFailed, match=r"graph_break|graph break"):
        LocalLauncher().run(fullgraph, 2)


def test_fsdp_on_one_rank_trains_the_whole_model_as_ddp_and_leaves_shards_that_two_ranks_resume(store, digits):
    """One rank has nothing to shard: no FSDP2 hooks (the plain module, the weights of a one-rank ddp fit), but the
    checkpoint is a folder of shards, so the run goes on with strategy='fsdp' on 2 ranks."""
    from dataclasses import replace

    from estimator.train.strategies.ddp import SOLO

    ddp = LocalLauncher().run(spec(store, digits, "one-ddp", epochs=1), 1)
    one = LocalLauncher().run(spec(store, digits, "one-fsdp", strategy="fsdp", epochs=1), 1)
    assert one[0].allreduce == ddp[0].allreduce == SOLO
    assert metrics(one[0].history[0]) == metrics(ddp[0].history[0])  # the same computation, bit for bit
    for name, value in trained(store, "one-ddp")[0].state_dict().items():
        assert torch.equal(trained(store, "one-fsdp")[0].state_dict()[name], value), name
    state = load_checkpoint(store, store.run("one-fsdp").checkpoint)
    assert "model" not in state and state["strategy"] == "fsdp"
    assert sorted(os.listdir(store.run("one-fsdp").root + "/sharded/" + state["sharded"])) == [
        ".metadata", "__0_0.distcp"]
    more = replace(spec(store, digits, "one-fsdp", strategy="fsdp", epochs=2), resume_from=store.run(
        "one-fsdp").checkpoint, batch_size=25, launch_id="more")  # the global batch of 50 kept
    two = LocalLauncher().run(more, 2)
    assert [row["epoch"] for row in two[0].history] == [1, 2] and "reduce-scatter" in two[0].allreduce
    assert two[0].state_bytes < 0.6 * one[0].state_bytes  # sharded now: half the state per rank


def test_auto_on_cpu_ranks_trains_the_whole_model_as_ddp_with_shards_that_fsdp_resumes(store, digits):
    """strategy='auto' shards only GPU ranks short of memory (estimator.train.sharding.auto_shards): on 2 CPU ranks
    the model trains whole (ddp's weights), the checkpoint is fsdp's folder, and fsdp on 2 ranks goes on from it."""
    from dataclasses import replace

    ddp = LocalLauncher().run(spec(store, digits, "auto-ddp", epochs=1), 2)
    auto = LocalLauncher().run(spec(store, digits, "auto", strategy="auto", epochs=1), 2)
    assert auto[0].allreduce == f"{ddp[0].allreduce}; strategy='auto': CPU ranks: the whole model on every rank " \
        f"(0.00 GiB of parameters, gradients and Adam's state)"
    assert metrics(auto[0].history[0]) == pytest.approx(metrics(ddp[0].history[0]), rel=1e-6)
    for name, value in trained(store, "auto-ddp")[0].state_dict().items():
        assert torch.allclose(trained(store, "auto")[0].state_dict()[name], value, atol=1e-6), name
    state = load_checkpoint(store, store.run("auto").checkpoint)
    assert state["strategy"] == "fsdp" and ".metadata" in os.listdir(
        store.run("auto").root + "/sharded/" + state["sharded"])
    more = replace(spec(store, digits, "auto", strategy="fsdp", epochs=2), resume_from=store.run("auto").checkpoint,
                   launch_id="more")
    two = LocalLauncher().run(more, 2)
    assert [row["epoch"] for row in two[0].history] == [1, 2] and "reduce-scatter" in two[0].allreduce


def cut_at_step_8(store, digits, run, strategy):
    """Rank 0 fails before step 8 of the epoch, after both ranks wrote the checkpoint of step 6: the run's state."""
    from estimator.core.faults import Fault
    from estimator.failures import RankFailed

    cut = spec(store, digits, run, strategy=strategy, checkpoint_steps=3, epochs=1, shared_memory_allreduce=False,
               collective_timeout=8.0)  # rank 1 waits for the failed rank 0 that long
    with pytest.raises(RankFailed):
        LocalLauncher(faults=(Fault("step", 0, "raise", step=8),)).run(cut, 2)
    state = load_checkpoint(store, cut.run.checkpoint)
    assert state["epoch"] == 0 and state["position"]["step"] == 6, state["position"]
    return cut


def resumed(store, cut, run, ranks):
    """A copy of the cut run continued on `ranks` ranks, the global batch of 100 kept."""
    from dataclasses import replace

    store.fs.copy(cut.run.root, store.run(run).root, recursive=True)
    again = replace(cut, run=store.run(run), resume_from=store.run(run).checkpoint, batch_size=100 // ranks,
                    attempt=1, launch_id="again")
    results = LocalLauncher().run(again, ranks)
    assert len(results) == ranks and [row["epoch"] for row in results[0].history] == [1]
    return trained(store, run)[0]


def test_a_sharded_run_stopped_inside_an_epoch_resumes_on_1_and_4_ranks_as_if_uninterrupted(store, digits):
    """The shards both ranks wrote at step 6 are DDP's whole state at step 6 (read on this process, no ranks). On
    1 or 4 ranks (the global batch of 100 kept) the rest of the epoch trains the old ranks' global batches, each
    dealt to the new ranks (estimator.data.remainder.kept_batches): every row left once, and the weights of the
    uninterrupted run."""
    whole = spec(store, digits, "whole", strategy="fsdp", checkpoint_steps=3, epochs=1, shared_memory_allreduce=False)
    LocalLauncher().run(whole, 2)
    expected = trained(store, "whole")[0].state_dict()
    sharded, plain = cut_at_step_8(store, digits, "cut", "fsdp"), cut_at_step_8(store, digits, "cut-ddp", "ddp")
    assert sorted(os.listdir(store.run("cut").root + "/sharded/step-6-launch-0")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
    (at_6, optimizer_at_6, _), (ddp_at_6, ddp_optimizer_at_6, _) = trained(store, "cut"), trained(store, "cut-ddp")
    for name, value in ddp_at_6.state_dict().items():
        assert torch.allclose(at_6.state_dict()[name], value, atol=1e-6), name
    for index, value in ddp_optimizer_at_6.state_dict()["state"].items():
        assert torch.allclose(optimizer_at_6.state_dict()["state"][index]["exp_avg"], value["exp_avg"], atol=1e-7)
    # (the same ranks resuming, and DDP's whole checkpoint on another rank count: test_fsdp_spark.py and
    # test_resize_spark.py)
    for run, cut, ranks in (("fsdp-1", sharded, 1), ("fsdp-4", sharded, 4)):
        weights = resumed(store, cut, run, ranks).state_dict()
        for name, value in expected.items():
            assert torch.allclose(weights[name], value, atol=1e-5), (run, name, (weights[name] - value).abs().max())
    folders = os.listdir(store.run("fsdp-4").root + "/sharded")
    final = load_checkpoint(store, store.run("fsdp-4").checkpoint)["sharded"]
    assert final.endswith("-again-1") and set(folders) == {final} | best_folders(store, "fsdp-4"), folders


def best_folders(store, run):
    best = store.run(run).best_dir
    return {load_checkpoint(store, p)["sharded"] for p in store.ls(best)} if store.exists(best) else set()


def test_a_sharded_checkpoint_of_another_model_or_strategy_is_refused_by_name(store):
    """The driver checks a run's shards against the model before a refit (DCP's own failure is a BaseException
    listing ranks: it comes out as the refit's ValueError with its first cause)."""
    import torch.distributed.checkpoint as dcp

    from estimator.fit.attempts import resume_point
    from estimator.train.checkpoint import Position, checkpoint_state, write_checkpoint
    from helpers import MLP

    model, run = BlockMLP(), store.run("kept")
    dcp.save({"model": model.state_dict()}, checkpoint_id=run.root + "/sharded/one", no_dist=True)
    write_checkpoint(store, checkpoint_state(model, torch.optim.Adam(model.parameters()), [{"loss": 1.0}],
                                             Position(1), sharded="one"), [run.checkpoint])
    assert resume_point(store, run, BlockMLP(), "kept", "fsdp") == (Position(1), [{"loss": 1.0}])
    assert resume_point(store, run, BlockMLP(), "kept", "auto") == (Position(1), [{"loss": 1.0}])  # fsdp's format
    with pytest.raises(ValueError, match=r"of a different model: .* Missing key in checkpoint state_dict: "
                                         r"model.net.0.weight"):
        resume_point(store, run, MLP(), "kept", "fsdp")
    with pytest.raises(ValueError, match=r"Size mismatch between saved torch.Size\(\[48, 64\]\)"):
        resume_point(store, run, BlockMLP(width=32), "kept", "fsdp")
    with pytest.raises(ValueError, match=r"written with strategy='fsdp', and this fit has strategy='ddp'"):
        resume_point(store, run, BlockMLP(), "kept", "ddp")


def test_ranks_sharing_a_gpu_are_refused_for_fsdp_before_any_job():
    from estimator.fit.strategy import check_shared_gpus

    with pytest.raises(ValueError, match=r"spark.task.resource.gpu.amount=0.5 puts several tasks on one GPU"):
        check_shared_gpus({"strategy": "fsdp", "use_gpu": None}, 0.5)
    for p, gpus in (({"strategy": "fsdp", "use_gpu": False}, 0.5), ({"strategy": "ddp", "use_gpu": None}, 0.5),
                    ({"strategy": "fsdp", "use_gpu": None}, 1.0), ({"strategy": "fsdp", "use_gpu": None}, 0.0)):
        check_shared_gpus(p, gpus)  # CPU ranks, DDP's gloo over a shared GPU, a whole GPU per task, no GPUs


def _two_generations(process, port, folder):
    """Process `process` is rank `process` in a first process group, then the other rank in a second, as a Spark
    worker reused by the next fit may be; each time it shards, steps and takes the state dicts a checkpoint takes."""
    import gc
    import json

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from torch.distributed.tensor import DTensor

    from estimator.train.distributed import forget_sharding_specs
    from estimator.train.sharding import shard

    for generation, rank in enumerate((process, 1 - process)):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + generation}", rank=rank, world_size=2)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))
        shard(model, None, "32", torch.device("cpu"), 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        nn.functional.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 10, (4,))).backward()
        optimizer.step()
        states = get_model_state_dict(model)
        get_optimizer_state_dict(model, optimizer)
        coordinates = {name: list(t.device_mesh.get_coordinate()) for name, t in states.items()}
        del model, optimizer, states
        gc.collect()
        dist.destroy_process_group()
        cached = [DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize,
                  torch._C._get_DTensor_sharding_propagator_cache_stats()]
        forget_sharding_specs()  # as run_rank does after every fit
        left = [DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize,
                torch._C._get_DTensor_sharding_propagator_cache_stats()]
        with open(os.path.join(folder, f"{process}-{generation}.json"), "w") as out:
            json.dump({"rank": rank, "coordinates": coordinates, "cached": cached, "left": left}, out)


def test_a_reused_process_with_another_rank_gives_its_shards_this_ranks_offsets(tmp_path):
    """DTensor caches each op's output spec per thread, and a mesh equals any other of its shape and names: without
    a mesh of its own per sharding, the second group's state dict came out on the first group's mesh, with the
    first rank's coordinates (checkpoints then saved shards at another rank's offsets). And the caches, which
    would grow with every fit's mesh in a long-lived worker, are emptied at the teardown."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_two_generations, args=(port, str(tmp_path)), nprocs=2)
    for process in (0, 1):
        for generation in (0, 1):
            seen = json.load(open(tmp_path / f"{process}-{generation}.json"))
            assert set(map(tuple, seen["coordinates"].values())) == {(seen["rank"],)}, (process, generation, seen)
            assert sum(seen["cached"][1]) > 0 and seen["left"] == [0, [0, 0]], seen  # emptied after each fit
