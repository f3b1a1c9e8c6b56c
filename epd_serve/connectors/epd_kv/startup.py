"""A worker's transfer engine made ready: started, KV memory registered, and (prefill)
the link calibrated by a loopback write. Any failure there is a start-up error that
says which step failed and which settings to check, never a fallback.

Runs in an engine worker process, from `worker.py register_kv_caches`, once. On an
H800 a misconfigured RDMA setup (wrong HCA, GID index, no GPUDirect) otherwise ends
the prefill instance with whatever the transfer engine said, deep in vLLM's start-up.
"""

from __future__ import annotations

from collections.abc import Callable

from epd_serve.connectors.epd_kv.grouping import LinkModel
from epd_serve.connectors.epd_kv.settings import Settings
from epd_serve.connectors.epd_kv.transfer import Link


class StartupError(RuntimeError):
    """The epd KV connector cannot move KV on this worker."""


def what_to_check(settings: Settings) -> str:
    if settings.protocol == "ascend":
        # The Ascend transport moves NPU memory with ADXL and reads no host-NIC setting
        # (device_name, gid_index, WITH_NVIDIA_PEERMEM do nothing there).
        return ("check that CANN's set_env.sh was sourced for the engine, that "
                "/etc/hccn.conf is present (mounted into a container), that the NPUs' "
                "RoCE addresses answer (hccn_tool -i <npu> -ip -g), and the ports "
                "ASCEND_BASE_PORT (20000) + 100 x <NPU id> are free; "
                "docs/atlas-800i-a2.md, section 2")
    return (f"check `protocol` ({settings.protocol!r}), `device_name` "
            f"({settings.device_name!r}) and `gid_index` ({settings.gid_index!r}) in "
            "kv_connector_extra_config (the deployment file's kv_connector_config), "
            "WITH_NVIDIA_PEERMEM (GPU memory over RDMA needs the nvidia-peermem module, "
            "or WITH_NVIDIA_PEERMEM=0 for dma-buf), and run `epd-serve doctor` on this host")


def open_link(settings: Settings, regions: list[tuple[int, int]], device_type: str,
              scratch: tuple[int, int] | None = None,
              make_link: Callable[..., Link] = Link,
              scratch_device_type: str = "cpu") -> tuple[Link, LinkModel | None]:
    """Start the transfer engine and register `regions` of KV memory on `device_type`;
    with a registered-to-be `scratch` (address, bytes, on `scratch_device_type`),
    calibrate the link through it. Raises `StartupError` naming the step that failed."""
    step = f"starting the transfer engine ({settings.protocol} on {settings.host})"
    try:
        link = make_link(settings.host, settings.protocol, settings.device_name,
                         settings.gid_index)
        step = (f"registering {len(regions)} region(s) of {device_type} KV cache memory "
                f"({sum(n for _, n in regions) / 2**30:.2f} GiB) with the {link.transport} "
                "transfer engine")
        link.register(regions, device_type)
        model = None
        if scratch is not None:
            step = f"registering the calibration buffer ({scratch_device_type} memory)"
            link.register([scratch], scratch_device_type)
            step = (f"the loopback calibration write through {link.session_id} "
                    f"({link.transport})")
            model = link.calibrate(*scratch)
    except Exception as err:
        raise StartupError(f"epd KV connector: {step} failed: {type(err).__name__}: {err}. "
                           f"It cannot move KV like this; {what_to_check(settings)}") from err
    return link, model
