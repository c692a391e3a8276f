"""dgr2 /tokenizer"""
