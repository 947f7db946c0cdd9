"""`python -m kvstore [--config YAML] [--set key=value ...]`: serve one store node, print its
address."""

from kvstore.server import main

raise SystemExit(main())
