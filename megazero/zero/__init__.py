ALIGN = 64
"""Elements (256 B in fp32) of ZeRO's partition alignment (partition.py); here, torch-free, because
zero.sub_group_size and zero.bucket_size are checked against it before torch loads."""
