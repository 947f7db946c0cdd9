"""Ray launcher, cluster configs and manifests."""
