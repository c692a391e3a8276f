"""dgr2 /decoding"""
