// Stands in for CUDA's cuda_bf16.h when tests/test_cuda_host.py compiles a .cu file with g++.
#pragma once
#include "../cuda_host.h"
