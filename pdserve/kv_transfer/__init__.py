"""KV block transfer between workers: layout checks, NIXL agent wrapper, prefill-side leases."""
from pdserve.kv_transfer.layout import KVLayout, KVLayoutMismatch, check_compatible  # noqa: F401
from pdserve.kv_transfer.lease import Lease, LeaseTable  # noqa: F401
