"""What a model's files say, read without torch: its config, tokenizer, chat template and
where its weights are. The engine process reads these; the worker builds the model from them.
"""
