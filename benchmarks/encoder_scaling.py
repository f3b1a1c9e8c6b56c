"""Do two encoder instances encode in parallel on this host? Straight to the engines.

Brings up configs/cpu/2e-pd.yaml and times encoder-only requests (672x672 images, new
ones each time, median of 5): one encoder with 1, 2 and 4 images; 2 + 2 images on both
encoders at once; two 2-image requests on one encoder at once. First with the
instances' threads where the CPU backend leaves them (shared cores), then with every
thread of e0 on core 0 and of e1 on core 1 (what two encoder devices are).

    scripts/in-netns.sh .venv/bin/python benchmarks/encoder_scaling.py
"""

from __future__ import annotations

import concurrent.futures as cf
import statistics
import time

import httpx
from proxy_real import pin_encoders  # benchmarks/ is on the path when run as a script

from epd_serve.runtime import bringup
from epd_serve.instances.payloads import image_data_url, make_image
from epd_serve.proxy.tenancy import image_key

SIDE = 672
ROUNDS = 5


def main() -> None:
    dep = bringup.load("configs/cpu/2e-pd.yaml")
    launcher = bringup.bring_up(dep, warmup=False)
    model = dep.launches[0].served_model_name
    urls = {launch.name: launch.url for launch in dep.launches}
    seeds = iter(range(700_000, 800_000))

    def body(images: int) -> dict:
        parts = []
        for _ in range(images):
            url = image_data_url(make_image(SIDE, SIDE, seed=next(seeds)))
            parts.append({"type": "image_url", "image_url": {"url": url},
                          "uuid": image_key(model, url)})
        return {"model": model, "messages": [{"role": "user", "content": parts}],
                "max_tokens": 1}

    def post(name: str, request: dict) -> None:
        httpx.post(urls[name] + "/v1/chat/completions", json=request,
                   timeout=300).raise_for_status()

    def trial(label: str, jobs: list[tuple[str, int]]) -> float:
        times = []
        for _ in range(ROUNDS):
            requests = [(name, body(images)) for name, images in jobs]
            start = time.perf_counter()
            with cf.ThreadPoolExecutor(len(requests)) as pool:
                list(pool.map(lambda job: post(*job), requests))
            times.append((time.perf_counter() - start) * 1e3)
        median = statistics.median(times)
        print(f"  {label:32s} median {median:6.0f} ms  {[round(t) for t in times]}", flush=True)
        return median

    try:
        for pinned in (False, True):
            print("every encoder thread on a core of its own:" if pinned else
                  "threads where the CPU backend leaves them:", flush=True)
            if pinned:
                pin_encoders(launcher)
            for images in (1, 2):
                trial(f"{images} image(s) on e0", [("e0", images)])
            one = trial("4 images on e0", [("e0", 4)])
            both = trial("2 + 2 on e0 and e1 at once", [("e0", 2), ("e1", 2)])
            trial("2 x 2 images on e0 at once", [("e0", 2), ("e0", 2)])
            print(f"  two encoders vs one: {one / both:.2f}x", flush=True)
    finally:
        launcher.stop()


if __name__ == "__main__":
    main()
