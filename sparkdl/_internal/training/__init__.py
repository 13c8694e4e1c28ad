"""What the parameter server and the workers share: flat buffers, optimizers, losses, the step loop, pipeline cuts."""
