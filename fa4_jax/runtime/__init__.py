"""The kernels at run time: device facts, the plan of a call, the FFI calls, the operands the
kernels read (packed GQA heads, split keys, span tables, mask bits), and the first-use gate."""
