"""Wrong answers made on purpose, so that every check that says "same answer" can be
shown to see one (the tests, and the chaos soak's canaries, benchmarks/chaos_soak.py):

- a feature taken from another image: the MM Store entry of an image nobody has sent
  yet replaced by another image's feature (same size, so the request still runs);
- a KV block lost: prefill leaves the first block decode reserved unwritten (it keeps
  what another request left there) and reports the transfer done (`SKIP_KV_BLOCK`,
  honoured only by a deployment with `fault_injection: true`, which no shipped file
  sets);
- two requests' answers crossed: judged against the other request's reference (no
  deployment needed: that is the judge's own test).
"""

from __future__ import annotations

from epd_serve.mmstore import StoreSpec, open_store
from epd_serve.proxy.tenancy import image_key

# kv_transfer_params of a request whose KV is to arrive with one block never written.
# Decode keeps that block in its prefix cache afterwards: a request carrying it must
# have a prompt of its own from its first block on, or later requests with the same
# prefix meet the wrong KV too.
SKIP_KV_BLOCK = {"epd_fault": "skip_block"}


def plant_foreign_feature(spec: StoreSpec, model: str, victim_url: str, donor_url: str) -> str:
    """Store the donor image's feature (the donor must have been sent already) under the
    key the proxy gives the victim image, which must not have been sent: a request for
    the victim then finds "its" feature stored, skips the encoder, and prefill computes
    the answer from the donor's. Returns the victim's key (`remove_feature` takes it
    out again)."""
    victim, donor = image_key(model, victim_url), image_key(model, donor_url)
    with open_store(spec) as store:
        found = store.get(donor)
        if found is None:
            raise LookupError(f"the donor's feature {donor} is not in the MM Store")
        data, meta = found
        store.delete(victim)
        if not store.put(victim, data, meta):
            raise RuntimeError(f"the MM Store refused the planted feature {victim}")
    return victim


def remove_feature(spec: StoreSpec, key: str) -> None:
    with open_store(spec) as store:
        store.delete(key)
