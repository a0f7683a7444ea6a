"""ZeRO-Offload and ZeRO-Infinity: this rank's optimizer step and states in host memory or on NVMe."""
