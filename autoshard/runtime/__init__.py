"""Running a program: the ParallelModule (DTensor parameters, autograd over the program), the wire meter."""
