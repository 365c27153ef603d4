"""What the tests share: tiny checkpoints, the transformers oracle, fakes and harnesses."""
