"""Ray Serve entry points of dgr2 (``serve.app:build_app``)."""
