from pathlib import Path

import pytest

from flotilla.cluster import gomod
from flotilla.cluster.versions import KUBERNETES_VERSION, staging_version

RELEASE = """module k8s.io/kubernetes

go 1.26.0

godebug default=go1.26

require (
\tk8s.io/api v0.0.0
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go // a comment
\tgithub.com/x/y v1.0.0 => github.com/x/y v1.0.1
)

replace k8s.io/kubectl => ./staging/src/k8s.io/kubectl
"""


def test_staging_modules_come_from_the_release_go_mod():
    assert gomod.staging_modules(RELEASE) == ["k8s.io/api", "k8s.io/client-go", "k8s.io/kubectl"]


def test_wrapper_replaces_each_staging_module_with_its_published_version():
    text = gomod.kubernetes_wrapper_gomod(RELEASE, "v1.36.3")
    assert "require k8s.io/kubernetes v1.36.3" in text
    assert "\tk8s.io/client-go => k8s.io/client-go v0.36.3" in text
    assert "godebug default=go1.26" in text and "go 1.26.0" in text
    assert "github.com/x/y" not in text


def test_staging_version():
    assert staging_version("v1.36.3") == "v0.36.3"
    with pytest.raises(ValueError):
        staging_version("v2.0.0")


def test_checked_in_wrapper_matches_the_pinned_release():
    """The committed go.mod must replace exactly the staging set at the pinned release's version."""
    text = (gomod.GOMOD_DIR / "kubernetes" / "go.mod").read_text()
    replaces = {r.module: r for r in gomod.parse_replaces(text)}
    assert f"k8s.io/kubernetes {KUBERNETES_VERSION}" in text
    published = staging_version()
    assert replaces and all(r.version == published and r.target == r.module for r in replaces.values())
    assert {"k8s.io/api", "k8s.io/apiserver", "k8s.io/client-go", "k8s.io/kubectl"} <= set(replaces)
    assert Path(gomod.GOMOD_DIR / "kubernetes" / "go.sum").exists()


def test_checked_in_replace_block_is_the_generated_one():
    """Regenerating from the release's go.mod (in the Go module cache after a build) changes nothing."""
    release = gomod.release_gomod_text("k8s.io/kubernetes", KUBERNETES_VERSION)
    generated = gomod.parse_replaces(gomod.kubernetes_wrapper_gomod(release))
    checked_in = gomod.parse_replaces((gomod.GOMOD_DIR / "kubernetes" / "go.mod").read_text())
    assert checked_in == generated
