"""Generation by continuous batching (transformers' ContinuousBatchingManager): the prompts of an Arrow batch queued
at once on a paged KV cache, a row leaving the running batch the step it ends and a waiting row taking its place
(CUDA graphs and flash attention on a GPU where transformers finds them). One manager per model and generation
settings in each executor's Python worker, kept on the model between Arrow batches (its cache and graphs with it;
its thread stopped between them, the model's attention restored). estimator.lm.generation chooses it or the padded
model.generate() by `batching_for`. torch and transformers only, no pyspark."""
from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# generate() keywords the continuous path honours (its logits processors: temperature, top-k, top-p; the stop
# tokens); any other keyword (num_beams, repetition_penalty, min_new_tokens, ...) is the padded path's
CONTINUOUS_KWARGS = frozenset({"do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id", "seed"})
# on a device without CUDA: a small cache (256 pages of 32 tokens), as a larger one is slower there (every step's
# attention reads the cache through a dense mask: 25 s against 6.8 s for 128 prompts, benchmarks/RESULTS.md)
HOST_CACHE = {"num_blocks": 256, "page_size": 32, "max_batch_tokens": 2048}
# on a GPU: the paged cache in at most half the memory free after the model (transformers' default, 0.9, would leave
# the worker's next model or a padded fallback none; at 1B parameters half an H100 holds about a million tokens)
GPU_CACHE = {"max_memory_percent": 0.5}
RESULT_WAIT = 60.0  # seconds without any finished row before the thread is asked whether it still runs


def continuous_refusal(generate_kwargs: Optional[Dict[str, Any]]) -> Optional[str]:
    """Why continuous batching cannot honour these generate() keywords, or None."""
    other = sorted(k for k in (generate_kwargs or {}) if k not in CONTINUOUS_KWARGS)
    if other:
        return (f"generate_kwargs {other} are model.generate's only (continuous batching honours "
                f"{sorted(CONTINUOUS_KWARGS)})")
    return None


def unsupported(model: Any) -> Optional[str]:
    """Why this model (or the installed transformers) has no continuous batching, or None."""
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401 - transformers >= 5.x
    except ImportError:
        import transformers

        return f"transformers {transformers.__version__} has no continuous batching (ContinuousBatchingConfig)"
    context = getattr(model, "continuous_batching_context_manager", None)
    if not callable(context):
        return f"{type(model).__name__} has no continuous_batching_context_manager (not a transformers causal LM)"
    taken = inspect.signature(context).parameters
    if not {"continuous_batching_config", "persistent_manager", "warmup"} <= set(taken):
        return "this transformers' continuous_batching_context_manager predates its config and kept managers"
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder model"
    return None


def settings_of(generate_kwargs: Dict[str, Any], device: str) -> Tuple[Any, ...]:
    """What a kept manager was built for: a manager is reused only for the same."""
    return (device, tuple(sorted((k, repr(v)) for k, v in generate_kwargs.items() if k != "seed")))


def manager_context(model: Any, generate_kwargs: Dict[str, Any], device: str):
    """The model's kept manager for these settings (a manager kept for others is destroyed first), as transformers'
    context manager: started on entry, stopped on exit and kept for the next Arrow batch."""
    from transformers import ContinuousBatchingConfig

    settings = settings_of(generate_kwargs, device)
    if getattr(model, "_estimator_continuous", None) != settings:
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if callable(destroy):
            destroy()
    config = copy.deepcopy(model.generation_config)  # the model's defaults under the user's keywords, as generate()
    config.update(**{k: v for k, v in generate_kwargs.items() if k != "seed"})
    on_gpu = device.startswith("cuda")
    batching = ContinuousBatchingConfig(**(GPU_CACHE if on_gpu else HOST_CACHE))
    context = model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=batching, persistent_manager=True, warmup=on_gpu)
    model._estimator_continuous = settings
    return context


def release(model: Any) -> None:
    """The model's kept manager destroyed (its cache's memory back), as the worker lets the model go."""
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if getattr(model, "_estimator_continuous", None) is not None and callable(destroy):
        destroy()
        model._estimator_continuous = None


def continuous_ids(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   generate_kwargs: Dict[str, Any], device: str) -> List[List[int]]:
    """The tokens generated for each prompt (ids), in the prompts' order. 'seed' in generate_kwargs seeds the
    sampling: the requests are queued while the manager's loop is paused, so each call schedules them alike."""
    seed = generate_kwargs.get("seed")
    with torch.inference_mode(False), torch.no_grad(), manager_context(model, generate_kwargs, device) as manager:
        with paused(manager):  # every request queued before the first step, the seed set before it
            if seed is not None:
                torch.manual_seed(int(seed))
            ids = manager.add_requests(inputs=[list(p) for p in prompts], max_new_tokens=max_new_tokens)
        if ids is None or len(ids) != len(prompts) or any(i is None for i in ids):
            raise RuntimeError("continuous batching did not take every prompt (its manager refused requests)")
        return collected(manager, ids)


def paused(manager: Any):
    """The manager's loop paused while the calling thread holds it (a transformers without pause: nothing)."""
    pause = getattr(manager, "pause", None)
    return pause() if callable(pause) else contextlib.nullcontext()


def collected(manager: Any, ids: Sequence[str]) -> List[List[int]]:
    """Each request's generated tokens once all have finished; a request that failed, or a generation thread that
    ended before all did, raises (never a row without its text)."""
    wanted = set(ids)
    done: Dict[str, List[int]] = {}
    while len(done) < len(wanted):
        result = manager.get_result(timeout=RESULT_WAIT)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"continuous batching's generation thread ended with {len(wanted) - len(done)} "
                                   f"of {len(wanted)} prompts unfinished (transformers logs its error above)")
            continue
        if result.request_id not in wanted or not result.is_finished():
            continue
        if getattr(result, "error", None) is not None:
            raise RuntimeError(f"continuous batching failed on a prompt: {result.error}")
        done[result.request_id] = list(result.generated_tokens)
    return [done[i] for i in ids]
