"""refusion-trt: ReFusion diffusion LLMs on ONNX Runtime and TensorRT."""
