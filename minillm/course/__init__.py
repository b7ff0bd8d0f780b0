"""Chapter material: the teaching modules each chapter builds on, one per chapter.

``ch01_variants`` (MHA/MQA/GQA/MLA written out), ``ch02_kv_memory`` (the KV memory calculator
for real model configs), ``ch04_workload`` (synthetic workloads, a step recorder and a virtual
clock for the engine), ``ch05_io_model`` (HBM traffic counted), ``ch06_sampling`` (speculative
sampling through the engine against the exact distribution), ``a2_roofline`` (the roofline
model, GPU specs, occupancy). The core never imports these.
"""
