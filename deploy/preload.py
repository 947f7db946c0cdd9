"""What the forkserver of deploy.local's server processes imports before it forks them.

Each server process of a LocalCluster starts from a fork of one process (multiprocessing's
forkserver) that has imported what every server imports: torch, gRPC, the four server packages.
The children share those pages copy-on-write, where a spawned child built its own: importing
torch alone costs a process ~140 MiB of private memory (its C++ registrations on the heap, ~560k
Python objects), and SmolLM2's bf16 cluster held 2.1 GB of PSS against 1.4 GB configured.

Nothing here starts a thread, opens a channel or loads the native kernels (a fork keeps only
the thread that forked, and the kernels' library reads HALFMOON_NATIVE when first used): the
forkserver only imports. Then it moves every object it holds out of the cyclic collector's
sight (gc.freeze): a child's collection would otherwise write into each inherited object's
header and so copy every page of them.
"""

from __future__ import annotations

import gc

import deploy.local  # noqa: F401 - the function each child runs
from servekit import ROLES, role_classes

for _role in ROLES:
    role_classes(_role)

gc.collect()
gc.freeze()
