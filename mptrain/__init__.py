"""mptrain: pretrain GPT and Llama models in any precision from fp32 down to 4-bit and the format lab's
emulated formats, on one device or a data- and tensor-parallel mesh, with every dtype stated."""
from mptrain.core.noise import silence_import_noise

silence_import_noise()  # before any submodule imports torchao, which logs at import
