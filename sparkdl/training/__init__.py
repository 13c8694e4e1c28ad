"""What both the parameter server and the workers use: flat buffers, optimizer, losses, step loop."""
