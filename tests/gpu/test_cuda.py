"""Every CUDA path, on a host with a CUDA GPU: `bash .ci/gpu` runs this module (and benchmarks/bench_gpu.py).
Skipped where torch sees no CUDA device (CI, and every machine this project has had so far).

No Spark is needed: the ranks run through LocalLauncher, the same per-rank code (device, process group,
reader, feed, loop, checkpoint) that Spark's barrier tasks run; transform's forward passes run through
estimator.predict.inference as a Spark task runs them. Where pyspark and Java are there too, the last test fits and
transforms through Spark with use_gpu=True (a local-cluster executor given GPU 0 by a discovery script)."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from estimator.data.arrays import tensors_to, to_tensors
from estimator.launch.local import LocalLauncher
from estimator.train.checkpoint import load_checkpoint, restore
from helpers import MLP, BlockMLP, make_spec, seeded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spec_for(store, digits, run, epochs=3, **fields):
    model = seeded(MLP)
    return make_spec(store, digits, model, torch.optim.Adam(model.parameters(), lr=0.01), train_rows=1400,
                     val_rows=300, epochs=epochs, run=run, use_gpu=True, **fields)


def final_state(store, spec):
    return load_checkpoint(store, spec.run.checkpoint, "cpu")


def test_one_rank_trains_alone_on_the_gpu(store, digits):
    (result,) = LocalLauncher().run(spec_for(store, digits, "one"), 1)
    assert result.device == "cuda:0" and result.allreduce == "nothing (one rank)"  # nccl starts; no DDP to average
    assert result.history[-1]["val_accuracy"] >= 0.85


def test_two_ranks_sharing_the_one_gpu_average_with_gloo(store, digits):
    results = LocalLauncher(use_processes=True).run(spec_for(store, digits, "shared", epochs=5), 2)
    assert [r.device for r in results] == ["cuda:0", "cuda:0"]
    assert [r.allreduce for r in results] == ["gloo", "gloo"]  # nccl refuses two ranks on one device
    assert results[0].history[-1]["val_accuracy"] >= 0.85


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_resume_continues_where_an_uninterrupted_run_goes(store, digits, precision):
    straight = spec_for(store, digits, f"straight-{precision}", epochs=2, precision=precision)
    LocalLauncher().run(straight, 1)
    first = spec_for(store, digits, f"resumed-{precision}", epochs=1, precision=precision)
    LocalLauncher().run(first, 1)
    (result,) = LocalLauncher().run(dataclasses.replace(first, epochs=2, resume_from=first.run.checkpoint), 1)
    assert result.history[-1]["val_accuracy"] >= 0.80
    a, b = final_state(store, straight), final_state(store, first)
    if precision == "16-mixed":  # the GradScaler's scale and growth tracker continue from the checkpoint
        assert a["grad_scaler"] and a["grad_scaler"] == b["grad_scaler"]
    for x, y in zip(a["model"].values(), b["model"].values()):
        assert torch.allclose(x, y, atol=1e-5), (x - y).abs().max()


def fsdp_spec(store, digits, run, epochs, **fields):
    model = seeded(BlockMLP)
    return make_spec(store, digits, model, torch.optim.AdamW(model.parameters(), lr=0.01), train_rows=1400,
                     val_rows=300, epochs=epochs, run=run, use_gpu=True, strategy="fsdp",
                     shard_alone=True, **fields)  # one GPU: FSDP2 sharding over one rank, as fit trains it on more


def restored(store, spec):
    model = BlockMLP()
    restore(store, spec.run, spec.run.checkpoint, model, torch.optim.AdamW(model.parameters(), lr=0.01))
    return model.state_dict()


def test_fsdp_bf16_mixed_on_cuda_checkpoints_its_shards_and_resumes_where_an_uninterrupted_run_goes(store,
                                                                                                     digits):
    """One rank (one GPU): fully_shard on a one-GPU mesh over nccl, bf16 compute with float32 master weights, the
    shards staged from the GPU and written by DCP in the background; a resume continues exactly."""
    straight = fsdp_spec(store, digits, "fsdp-straight", 2, precision="bf16-mixed")
    (result,) = LocalLauncher().run(straight, 1)
    assert result.device == "cuda:0" and result.allreduce.startswith("nccl reduce-scatter (fsdp")
    assert result.history[-1]["val_accuracy"] >= 0.80
    first = fsdp_spec(store, digits, "fsdp-resumed", 1, precision="bf16-mixed")
    LocalLauncher().run(first, 1)
    LocalLauncher().run(dataclasses.replace(first, epochs=2, resume_from=first.run.checkpoint), 1)
    a, b = restored(store, straight), restored(store, first)
    assert {v.dtype for v in a.values()} == {torch.float32}
    for name, value in a.items():
        assert torch.allclose(b[name], value, atol=1e-5), (name, (b[name] - value).abs().max())


def test_fsdp_with_its_blocks_compiled_by_inductor_on_cuda_trains_what_eager_fsdp_trains(store, digits):
    """compile=True with fsdp: each block compiled by inductor (triton kernels on the GPU) before it is sharded;
    float32, one rank: the weights of the eager run to a kernel's rounding."""
    eager, fast = fsdp_spec(store, digits, "fsdp-eager", 1), fsdp_spec(store, digits, "fsdp-inductor", 1, compile=True)
    LocalLauncher().run(eager, 1)
    (result,) = LocalLauncher().run(fast, 1)
    assert result.history[-1]["val_accuracy"] >= 0.80
    expected = restored(store, eager)
    for name, value in restored(store, fast).items():
        assert torch.allclose(value, expected[name], atol=1e-3), (name, (value - expected[name]).abs().max())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks on nccl need two GPUs")
def test_fsdp_on_two_gpus_trains_the_weights_of_ddp_on_two_gpus(store, digits):
    fsdp = fsdp_spec(store, digits, "fsdp-two", 2)
    model = seeded(BlockMLP)
    ddp = make_spec(store, digits, model, torch.optim.AdamW(model.parameters(), lr=0.01), train_rows=1400,
                    val_rows=300, epochs=2, run="ddp-two", use_gpu=True)
    results = LocalLauncher(use_processes=True).run(fsdp, 2)
    LocalLauncher(use_processes=True).run(ddp, 2)
    assert [r.device for r in results] == ["cuda:0", "cuda:1"]
    expected = load_checkpoint(store, ddp.run.checkpoint, "cpu")["model"]
    for name, value in restored(store, fsdp).items():
        assert torch.allclose(value, expected[name], atol=1e-4), name


def test_the_feed_pins_host_memory_and_copies_without_blocking(store, digits):
    spec = spec_for(store, digits, "pinned")
    batch = {"features": digits[0][:64], "label": digits[1][:64]}
    host = to_tensors(batch, spec.data, pin=True)
    assert all(t.is_pinned() for t in host[0] + host[1])
    features, labels, _ = tensors_to(host, torch.device("cuda:0"))
    torch.cuda.synchronize()
    assert features[0].device.type == "cuda" and torch.equal(labels[0].cpu(), torch.from_numpy(digits[1][:64]))
    (result,) = LocalLauncher().run(spec, 1)  # the whole loop, fed from pinned memory
    assert result.data_wait_seconds < result.train_loop_seconds


def test_compile_on_cuda_trains_the_weights_of_an_uncompiled_fit(store, digits):
    plain, fast = spec_for(store, digits, "eager", epochs=2), spec_for(store, digits, "compiled", epochs=2,
                                                                         compile=True)
    LocalLauncher().run(plain, 1)
    LocalLauncher().run(fast, 1)
    for x, y in zip(final_state(store, plain)["model"].values(), final_state(store, fast)["model"].values()):
        assert torch.allclose(x, y, atol=1e-3), (x - y).abs().max()


def test_transform_forward_passes_on_the_gpu_equal_the_cpu_ones(digits):
    import cloudpickle

    from estimator.predict.inference import predict_numpy

    model = seeded(MLP).eval()
    blob = cloudpickle.dumps(model)
    on_gpu = predict_numpy(cloudpickle.loads(blob).to("cuda:0"), [digits[0]], 256, "cuda:0")[0]
    on_cpu = predict_numpy(model, [digits[0]], 256, "cpu")[0]
    assert np.allclose(on_gpu, on_cpu, atol=1e-4)


@pytest.mark.skipif(shutil.which("java") is None, reason="no Java: Spark cannot start")
def test_a_spark_fit_and_transform_with_use_gpu_true(tmp_path):
    pytest.importorskip("pyspark")
    script = tmp_path / "gpus.sh"
    script.write_text("#!/bin/bash\necho '{\"name\": \"gpu\", \"addresses\": [\"0\"]}'\n")
    script.chmod(0o755)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "seeds", "spark_gpu_job.py"), str(script),
                             str(tmp_path / "store")], capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                            env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable,
                                     PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert out["device"] == "cuda:0" and out["allreduce"] == "nothing" and out["accuracy"] >= 0.85
