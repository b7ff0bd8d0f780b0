"""The serving engine (chapter 04): sequences, block manager, scheduler, model runner, LLM API."""
