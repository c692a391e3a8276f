"""Serving: the reranker bundle format, the re-ranker core and its settings (Ray Serve app in serve/)."""
