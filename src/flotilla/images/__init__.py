"""Flotilla's container images built on this machine from the unchanged Dockerfile: `flotilla images`.

No base image can be pulled here, so the bases the Dockerfile names are made from Debian's own packages
(recipe.py says what is in them, base.py makes them), then buildah builds each target (build.py)."""
