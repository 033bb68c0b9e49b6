"""What the Miles stand-in shapes share: arguments, training on the CPU harness, stock checkpoint I/O,
the driver (Miles' train.py), and stand-ins for the few Megatron-LM functions Miles imports."""
