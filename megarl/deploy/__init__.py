"""Checks of what megarl deploys: KubeRay manifests (`megarl check-manifests`, megarl.cli.check_manifests)."""
