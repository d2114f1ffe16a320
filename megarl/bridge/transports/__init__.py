"""Weight transports behind one interface (`base.WeightTransport`), one file each."""

from megarl.bridge.transports.base import Buckets, WeightTransport
from megarl.bridge.transports.in_process import InProcessTransport
from megarl.bridge.transports.shared_memory import SharedMemoryTransport

__all__ = ["Buckets", "InProcessTransport", "SharedMemoryTransport", "WeightTransport"]
