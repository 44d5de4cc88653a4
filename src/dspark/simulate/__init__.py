"""The serving load test on paper: a discrete-event model of the engine driving the production verify policies."""
