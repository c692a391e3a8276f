"""dgr2 /traces"""
