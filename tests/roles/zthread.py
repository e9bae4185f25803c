"""A preload that leaves a thread running in the zygote: every fork must be refused."""

from __future__ import annotations

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
