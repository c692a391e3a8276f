"""dgr2 /rollout"""
