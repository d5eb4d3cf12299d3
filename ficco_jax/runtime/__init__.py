"""The native side as Python sees it: loading the compiled extension (`extension`, with its stale
check), which devices the copy engines reach (`topology`), and CUDA IPC between the processes of
one host (`ipc`)."""
