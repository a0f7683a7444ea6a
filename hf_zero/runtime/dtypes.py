"""The dtypes as safetensors files name them, both ways: checkpoints, exports and pretrained loading read them."""
import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}  # as safetensors' get_dtype() spells them
