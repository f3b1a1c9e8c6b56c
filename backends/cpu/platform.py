"""CPU platform: how a vllm-cpu engine process is started.

Pure builders; runs in the launcher. The engine itself is started as
`python -m vllm.entrypoints.openai.api_server` because the `vllm` console script of
the `vllm-cpu` distribution fails its own version lookup; `python` is the deployment's
`engine_python` where it names one (Platform.launcher_for), else epd-serve's own.
"""

from __future__ import annotations

import importlib.util
import math

from epd_serve.backends.cpu import amx, idle_wait, sampler_warmup
from epd_serve.backends.hal import InstanceLaunch, Platform, python_module_launcher
from epd_serve.protocols.registry import Connector


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    device_visibility_env = None  # a "device" is a logical slot on the host's cores
    memory_flag = None  # memory is given as KV-cache GiB through the environment
    attention_backend = None  # vllm-cpu picks its own CPU attention
    # KV connectors (epd, mooncake): the registry's entries for "cpu"
    # (protocols/registry.py).
    ray_resource = "CPU"
    default_kv_protocol = "epd"
    ec_connector = Connector("EPDExampleECConnector", "epd_serve.connectors.ec_example")
    # KV cache GiB one logical device holds, split between co-located instances.
    kv_cache_gib_per_device = 2

    def engine_launcher(self) -> list[str]:
        return [*python_module_launcher("vllm.entrypoints.openai.api_server"), "--model"]

    def kv_cache_gib(self, launch: InstanceLaunch) -> int:
        return max(1, math.floor(self.kv_cache_gib_per_device * launch.memory_share))

    def platform_args(self, launch: InstanceLaunch) -> list[str]:
        # torch.compile and graph capture cost ~30 s of start-up on two cores and buy
        # nothing for a tiny model.
        return [] if launch.encoder_only else ["--enforce-eager"]

    def platform_env(self, launch: InstanceLaunch) -> dict[str, str]:
        env = {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib(launch)),
            # With the default "auto" binding on a small host every instance's OpenMP
            # threads land on the same core and Mooncake transfers time out.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            # OpenMP threads otherwise spin after every parallel region (up to 200 ms
            # with Intel's runtime), stealing the shared cores from the other instances:
            # measured on E-P-D, 2 cores, a text request took 945 ms spinning, 342 ms not.
            # A short spin (GOMP_SPINCOUNT=100000) bought nothing either (request_latency.py,
            # A B, 2 rounds): E-P-D with it everywhere and two decode threads, text 265 vs
            # 237 ms, image 601 vs 562; it speeds TP1 up more than E-P-D (text ratio 1.42
            # with it on both vs ~1.1-1.2 without).
            "OMP_WAIT_POLICY": "PASSIVE",
            "KMP_BLOCKTIME": "0",
            # vLLM's CPU attention otherwise splits a sequence's KV over the OpenMP threads
            # once it is long enough (an image request's ~110 tokens are), a cross-thread
            # wait in every layer of every step; with passive waits on a small shared host
            # an image request's first ~8 decode steps then took 7-11 ms, not 4
            # (measured on TP1, 2 cores: median TPOT 5.2-5.8 ms split, 3.1-3.8 not; text
            # 3.0-3.5 either way). A host with cores to spare may set it back (`env`).
            "VLLM_CPU_ATTN_SPLIT_KV": "0",
            # Our vLLM plugin asks for AMX tiles in every engine process: without it a
            # decode instance dies (SIGILL) in its first attention on an AMX CPU.
            amx.ENV: "1",
            # vLLM's queue readers otherwise spin for 1 s after every read, on the cores
            # the instance computing needs (backends/cpu/idle_wait.py); they nap instead,
            # for as long as idle_wait.NAP_MS says (why that long: there).
            idle_wait.ENV: str(idle_wait.NAP_MS),
        }
        if not launch.encoder_only:
            # Its workers compile the sampler's logprob-rank kernel at start, not in the
            # first logprobs request's step (backends/cpu/sampler_warmup.py).
            env[sampler_warmup.ENV] = "1"
        if launch.kv_role is not None:
            env["MC_FORCE_TCP"] = "1"
        return env

    def host_memory_gib(self, launch: InstanceLaunch) -> float:
        # Measured RSS with vllm-cpu 0.32: API server 1.15 GB, engine core 1.12 GB, worker
        # 2.33 GB of which 1 GiB was KV cache. Each worker takes VLLM_CPU_KVCACHE_SPACE
        # (the deployment file's `env` may override ours), except an encoder-only one,
        # which allocates no KV cache (benchmarks/encoder_kind.py: 3.4 GiB for the tiny
        # model's encoder-only instance, 6.0 GiB for a switchable E~ beside it).
        kv_gib = 0.0 if launch.encoder_only \
            else float(self.environment(launch)["VLLM_CPU_KVCACHE_SPACE"])
        gb = 1e9 / 2**30
        return (1.15 + 1.12) * gb + launch.instance.tensor_parallel * (1.33 * gb + kv_gib)

    def check_available(self) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                "vLLM is not installed: install the CPU extra with scripts/setup.sh "
                "(or pip install 'epd-serve[cpu]')"
            )


PLATFORM = CpuPlatform()
