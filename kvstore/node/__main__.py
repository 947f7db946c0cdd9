"""`python -m kvstore.node [--config YAML] [--set key=value ...]`: serve one store node, print its
address."""

from kvstore.node.server import main

raise SystemExit(main())
