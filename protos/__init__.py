"""halfmoon.proto and its generated Python modules (`make protos` regenerates them)."""
