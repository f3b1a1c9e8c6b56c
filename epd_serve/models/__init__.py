"""Models built here instead of downloaded: a tiny random-weight Qwen-VL-family model, offline."""
