"""dgr2 /models"""
