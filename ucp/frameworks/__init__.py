"""The owners of other frameworks' on-disk layouts (DeepSpeed's is :mod:`ucp.deepspeed`): what their files are
called and hold, read and checked in one place, for the sources that read them and the targets that write them."""
