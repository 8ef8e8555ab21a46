"""mptrain: pretrain GPT-style models in fp32, fp16, bf16 and fp8, with every dtype stated."""
from mptrain.core.noise import silence_import_noise

silence_import_noise()  # before any submodule imports torchao, which logs at import
