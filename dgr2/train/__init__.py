"""dgr2 /train"""
